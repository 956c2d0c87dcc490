//! Loop tests: config, replay draws, positions.

use super::replay::{mix, replay_draw, replay_indices};
use super::source::key;
use super::*;

#[test]
fn defaults_are_valid_and_unknown_fields_refused() {
    let cfg = LearnerConfig::default();
    cfg.validate().unwrap();
    assert_eq!(cfg.served_base_name(), "SmolLM2-135M-Instruct.Q4_1");
    assert!(serde_json::from_value::<LearnerConfig>(json!({"token_budgt": 3})).is_err());
    let bad = LearnerConfig {
        adapter_name: "a@b".into(),
        ..Default::default()
    };
    assert!(bad.validate().is_err());
    let no_buffer = LearnerConfig {
        replay_steps_per_batch: 2,
        replay_buffer_examples: 0,
        ..Default::default()
    };
    assert!(no_buffer.validate().is_err());
}

#[test]
fn the_replay_buffer_keeps_what_was_learned_from_and_drops_the_oldest() {
    let ex = |i: u32| TrainExample {
        record_id: Uuid::from_u128(u128::from(i)),
        turn: Uuid::from_u128(u128::from(i)),
        route: "r".into(),
        adapter: None,
        context_ids: vec![1],
        answer_ids: vec![2],
        behaviour_logprobs: None,
        sampling: Default::default(),
        teacher_context_ids: None,
        control_context_ids: None,
        correction_ids: None,
        answer_format: None,
        thumbs: None,
        reward: None,
        feedback_text: None,
        feedback_ids: vec![],
    };
    let ids = |r: &VecDeque<TrainExample>| -> Vec<u128> {
        r.iter().map(|e| e.record_id.as_u128()).collect()
    };
    let mut replay = VecDeque::new();
    let unlearned = [Uuid::from_u128(2)];
    assert_eq!(
        remember_for_replay(&mut replay, vec![ex(1), ex(2), ex(3)], &unlearned, 3),
        2
    );
    assert_eq!(ids(&replay), vec![1, 3], "the unlearned example stays out");
    assert_eq!(
        remember_for_replay(&mut replay, vec![ex(4), ex(5)], &[], 3),
        2
    );
    assert_eq!(ids(&replay), vec![3, 4, 5], "oldest out beyond the cap");
}

#[test]
fn replay_draws_distinct_indices_deterministically_and_covers_the_buffer() {
    for len in [1usize, 2, 5, 40] {
        for n in [1usize, 3, 8] {
            let a = replay_indices(len, n, 42);
            assert_eq!(a, replay_indices(len, n, 42));
            assert_eq!(a.len(), n.min(len));
            let mut sorted = a.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), a.len(), "duplicates in {a:?}");
            assert!(a.iter().all(|&i| i < len));
        }
    }
    // A batch's draw for all its replay steps: distinct up to the buffer's size, then
    // balanced passes (each index at most once more than any other).
    assert!(replay_draw(0, 4, 7).is_empty());
    for (len, n) in [(1usize, 4usize), (3, 2), (3, 7), (10, 10)] {
        let d = replay_draw(len, n, 7);
        assert_eq!(d.len(), n);
        let mut counts = vec![0usize; len];
        for &i in &d {
            counts[i] += 1;
        }
        let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
        assert!(hi - lo <= 1, "unbalanced draw {len} {n}: {d:?}");
        if n <= len {
            assert!(*hi == 1, "repeat within one draw: {d:?}");
        }
    }
    // Over many keys every slot of the buffer gets drawn, roughly evenly.
    let mut hits = [0usize; 10];
    for key in 0..2000u64 {
        hits[replay_indices(10, 1, mix(key))[0]] += 1;
    }
    assert!(hits.iter().all(|&h| (120..=280).contains(&h)), "{hits:?}");
}

/// The documented example parses, and its `[learner]` values are the defaults it claims.
#[test]
fn example_config_parses_and_shows_the_defaults() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/learner.example.toml"
    );
    let text = std::fs::read_to_string(path).unwrap();
    let file: LearnerFile = parse_example(&text);
    let shown = serde_json::to_value(&file.learner).unwrap();
    let default = serde_json::to_value(LearnerConfig::default()).unwrap();
    assert_eq!(
        shown, default,
        "deploy/learner.example.toml drifted from the defaults"
    );
    file.learner.validate().unwrap();
    assert!(file.registry.is_some() && file.publish.is_some());
    let guard = file
        .publish
        .as_ref()
        .and_then(|p| p.gate.as_ref())
        .map(|g| &g.guard);
    assert_eq!(
        guard,
        Some(&hindsight_control::guard::GuardConfig::default()),
        "deploy/learner.example.toml's [publish.gate.guard] drifted from the defaults"
    );
}

fn parse_example(text: &str) -> LearnerFile {
    // The binary reads it through hindsight_core::load_toml (same TOML crate, same serde).
    let value: serde_json::Value = toml_to_json(text);
    serde_json::from_value(value).unwrap()
}

fn toml_to_json(text: &str) -> serde_json::Value {
    let table: toml::Table = text.parse().unwrap();
    serde_json::to_value(table).unwrap()
}

#[test]
fn positions_round_trip_through_keys() {
    let mut m = BTreeMap::new();
    m.insert(key("hindsight.episodes", 3), 17);
    let p = to_positions(&m);
    assert_eq!(p[&("hindsight.episodes".to_string(), 3)], 17);
}

/// A nested table that sets one key keeps every other key's default: the same defaults as a
/// file without the table (an `[optimizer]` table once got lr 1e-4 where the trainer's was
/// 5e-4, and a `[lora]` table rank 16 where the trainer's was 8).
#[test]
fn a_partial_nested_table_keeps_the_defaults_of_the_whole() {
    let file = parse_example(
        "[learner.trainer.optimizer]\nbeta1 = 0.8\n[learner.trainer.lora]\ndropout = 0.1\n",
    );
    let d = LearnerConfig::default();
    let t = &file.learner.trainer;
    assert_eq!(t.optimizer.beta1, 0.8);
    assert_eq!(t.optimizer.lr, d.trainer.optimizer.lr);
    assert_eq!(
        (t.lora.rank, t.lora.alpha),
        (d.trainer.lora.rank, d.trainer.lora.alpha)
    );
    assert_eq!(t.lora.dropout, 0.1);
}
