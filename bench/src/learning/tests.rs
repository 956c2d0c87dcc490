//! Harness tests: baselines, eval-set prefixes, service checks, labels, config.

#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::config::json_of;
use super::plot::wrap_label;
use super::services::{service_addrs, services_listen};
use super::*;
use hindsight_learner::online::LearnerConfig;
use hindsight_sim::eval_items;

/// Environment overrides as `BenchFile::load` takes them.
fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn the_constant_baseline_is_the_most_common_training_decision_scored_by_the_eval() {
    let world = World::new(0);
    let options = single_turn(Records::Json);
    let eval = EvalSet::from_items("e", eval_items(&world, Split::Eval, 40, options)).unwrap();
    let b = ConstantBaseline::compute(&world, options, &Sop::default(), &eval, None).unwrap();
    let train = eval_items(&world, Split::Train, CONSTANT_BASELINE_TICKETS, options);
    let share = |v: &serde_json::Value| {
        train.iter().filter(|t| &t.expected == v).count() as f64 / train.len() as f64
    };
    assert!((share(&b.answer) - b.train_share).abs() < 1e-12);
    assert!(train.iter().all(|t| share(&t.expected) <= b.train_share));
    let hits = eval.items.iter().filter(|i| i.expected == b.answer).count();
    assert!((b.exact_match - hits as f64 / 40.0).abs() < 1e-12);
    assert!(b.field_accuracy >= b.exact_match && b.field_accuracy <= 1.0);
    assert!(b.train_exact_match.is_none());
}

#[test]
fn exact_beyond_the_constant_answer_counts_only_the_other_tickets() {
    let world = World::new(0);
    let eval = EvalSet::from_items(
        "e",
        eval_items(&world, Split::Eval, 40, single_turn(Records::Json)),
    )
    .unwrap();
    let b = ConstantBaseline::compute(
        &world,
        single_turn(Records::Json),
        &Sop::default(),
        &eval,
        None,
    )
    .unwrap();
    let expected: Vec<&serde_json::Value> = eval.items.iter().map(|i| &i.expected).collect();
    let others = expected.iter().filter(|e| ***e != b.answer).count();
    assert!(others > 0 && others < 40, "{others}");
    // Right exactly on the constant answer's tickets (what always giving it scores): 0.
    let on_constant = expected
        .iter()
        .map(|e| (*e, f64::from(u8::from(**e == b.answer))));
    assert_eq!(beyond_constant(on_constant, &b.answer), Some((0.0, others)));
    // Right on every ticket: 1; on one of the others: 1 / others.
    let all = expected.iter().map(|e| (*e, 1.0));
    assert_eq!(beyond_constant(all, &b.answer), Some((1.0, others)));
    let first = expected.iter().position(|e| **e != b.answer).unwrap();
    let one = expected
        .iter()
        .enumerate()
        .map(|(i, e)| (*e, f64::from(u8::from(i == first))));
    let (rate, n) = beyond_constant(one, &b.answer).unwrap();
    assert!((rate - 1.0 / others as f64).abs() < 1e-12 && n == others);
    assert_eq!(beyond_constant(std::iter::empty(), &b.answer), None);
}

#[test]
fn a_longer_eval_set_starts_with_the_shorter_one_and_its_prefix_is_scored_alone() {
    let world = World::new(0);
    let options = single_turn(Records::Compact);
    let short = eval_items(&world, Split::Eval, HISTORY_EVAL_ITEMS, options);
    let long = eval_items(&world, Split::Eval, 3 * HISTORY_EVAL_ITEMS, options);
    assert_eq!(short, long[..HISTORY_EVAL_ITEMS]);
    let set = EvalSet::from_items("e", long).unwrap();
    // Right on every third ticket: 21 of 60 right, 7 of the first 20.
    let outcome = |(i, item): (usize, &hindsight_eval::EvalItem)| {
        let pass = f64::from(u8::from(i % 3 == 0));
        serde_json::json!({"id": item.id, "scorer": "json_exact", "correct": pass as usize,
            "pass_rate": pass, "mean_score": pass, "pass_at_k": {}, "samples": []})
    };
    let report: RunReport = serde_json::from_value(serde_json::json!({
        "schema": "x", "endpoint": "x", "model": "m", "adapter_versions": [],
        "set": {"name": "e", "sha256": set.sha256, "items": set.items.len()},
        "seed": 0, "samples": 1, "temperature": 0.0, "started_at_ms": 0, "duration_ms": 0,
        "metrics": {"items": 60, "samples": 60, "exact_match": 0.35, "mean_score": 0.35,
            "pass_at_k": {}, "unparseable": {}, "request_errors": 0,
            "tool_calls_per_sample": 0.0, "mean_latency_ms": 0.0},
        "items": set.items.iter().enumerate().map(outcome).collect::<Vec<_>>(),
    }))
    .unwrap();
    let passed = passed_items(&report);
    assert_eq!(passed.len(), 20);
    assert!(passed.iter().all(|i| i % 3 == 0));
    let point = CurvePoint {
        events: 0,
        examples: 0,
        exact_match: 20.0 / 60.0,
        field_accuracy: None,
        train_exact_match: None,
        train_field_accuracy: None,
        distinct_answers: None,
        top_answer_share: None,
        exact_beyond_constant: None,
        prior_margin: None,
        train_prior_margin: None,
        passed,
        version: None,
        wall_s: 0.0,
        rule_change: None,
    };
    assert!((point.exact_on_first(HISTORY_EVAL_ITEMS) - 7.0 / 20.0).abs() < 1e-12);
    assert!((point.exact_on_first(60) - point.exact_match).abs() < 1e-12);
    let first = first_items(&set, &report, HISTORY_EVAL_ITEMS);
    assert_eq!(first.items, report.items[..HISTORY_EVAL_ITEMS]);
    // Against a run right on none of them: +7 of 20, paired.
    let mut none = report.clone();
    for o in &mut none.items {
        o.pass_rate = 0.0;
    }
    let c = compare_runs(
        &first_items(&set, &none, HISTORY_EVAL_ITEMS),
        &first,
        1000,
        0,
    )
    .unwrap();
    assert_eq!(c.items, HISTORY_EVAL_ITEMS);
    assert!(
        (c.exact_match.diff - 0.35).abs() < 1e-12,
        "{:?}",
        c.exact_match
    );
}

#[test]
fn service_addresses_come_from_the_broker_list_and_the_redis_url() {
    let addrs = service_addrs("127.0.0.1:9092, k2:9093", "redis://:pw@r:6380/0").unwrap();
    let addrs: Vec<&str> = addrs.iter().map(|(_, a)| a.as_str()).collect();
    assert_eq!(addrs, ["127.0.0.1:9092", "k2:9093", "r:6380"]);
    let (what, addr) = service_addrs("b:1", "redis://localhost")
        .unwrap()
        .pop()
        .unwrap();
    assert_eq!((what, addr.as_str()), ("Redis", "localhost:6379"));
    assert!(service_addrs("", "redis://r/").is_err());
    assert!(service_addrs("b:1", "http://r/").is_err());
}

#[tokio::test]
async fn a_service_that_does_not_listen_is_named_with_what_to_run() {
    // A port just released: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listening = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let up = listening.local_addr().unwrap().to_string();
    let err = services_listen(&format!("127.0.0.1:{port}"), &format!("redis://{up}/"))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("Kafka broker") && err.contains("deploy/services.sh up"),
        "{err}"
    );
    let err = services_listen(&up, &format!("redis://127.0.0.1:{port}/"))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("Redis"), "{err}");
    services_listen(&up, &format!("redis://{up}/"))
        .await
        .unwrap();
}

#[test]
fn legend_labels_wrap_between_settings() {
    let label = "distill + replay 2, lr 1e-3, compact records, frozen teacher";
    assert_eq!(wrap_label(label, 200), vec![label]);
    assert_eq!(
        wrap_label(label, 30),
        vec![
            "distill + replay 2, lr 1e-3,",
            "compact records,",
            "frozen teacher"
        ]
    );
    // A setting longer than the width gets its own line rather than being cut.
    assert_eq!(
        wrap_label("a, a very long setting, b", 8),
        vec!["a,", "a very long setting,", "b"]
    );
    assert_eq!(wrap_label("", 10), vec![""]);
}

#[test]
fn curve_labels_name_what_differs_from_the_defaults() {
    let mut cfg = LearningConfig::new(Objective::Default, "/tmp/x");
    assert_eq!(cfg.label(), "default");
    cfg.scenario.seed = 1;
    cfg.learner.replay_steps_per_batch = 2;
    cfg.learner.trainer.optimizer.lr = 3e-3;
    assert_eq!(
        cfg.label(),
        "default, seed=1, replay_steps_per_batch=2, trainer.optimizer.lr=0.003"
    );
    cfg.learner.trainer.divergence = hindsight_learner::objectives::Divergence::ReverseKl;
    assert!(
        cfg.label().contains(", trainer.divergence=reverse_kl"),
        "{}",
        cfg.label()
    );
    // The objective names the mix; the files the harness places are not settings.
    let mut kto = LearningConfig::new(Objective::Kto, "/tmp/y");
    kto.learner.model_path = "/elsewhere/model.gguf".into();
    assert_eq!(kto.label(), "kto");
}

#[test]
fn the_bench_reads_the_learner_config_and_fails_loudly_on_a_bad_value() {
    let f = BenchFile::load(
        None,
        env(&[
            ("HINDSIGHT_LEARNER__TRAINER__OPTIMIZER__LR", "2e-3"),
            ("HINDSIGHT_SCENARIO__CORRECTION_RATE", "0.3"),
        ]),
    )
    .unwrap();
    assert_eq!(f.learner.trainer.optimizer.lr, 2e-3);
    assert_eq!(f.scenario.correction_rate, 0.3);
    // The defaults are the measured recipe and the headline scenario.
    let d = BenchFile::load(None, env(&[])).unwrap();
    assert_eq!(json_of(&d.learner), json_of(&LearnerConfig::default()));
    assert_eq!((d.scenario.events, d.scenario.eval_items), (64, 60));
    let bad = BenchFile::load(
        None,
        env(&[("HINDSIGHT_LEARNER__TRAINER__OPTIMIZER__LR", "1e-3x")]),
    )
    .unwrap_err()
    .to_string();
    assert!(bad.contains("learner.trainer.optimizer.lr"), "{bad}");
    let unknown = BenchFile::load(None, env(&[("HINDSIGHT_SCENARIO__EVENT", "3")]))
        .unwrap_err()
        .to_string();
    assert!(unknown.contains("unknown field `event`"), "{unknown}");
}

/// The experimental knobs are read from `[learner.trainer.experimental]` like any other (the
/// edit probe's configurations), their label names the table, and the knobs removed for losing
/// every comparison are refused by name.
#[test]
fn the_bench_reads_experimental_knobs_and_refuses_removed_ones() {
    let f = BenchFile::load(
        None,
        env(&[
            (
                "HINDSIGHT_LEARNER__TRAINER__EXPERIMENTAL__EDIT_TARGET",
                "true",
            ),
            (
                "HINDSIGHT_LEARNER__TRAINER__EXPERIMENTAL__TEACHER_CONTRAST",
                "1",
            ),
        ]),
    )
    .unwrap();
    let x = &f.learner.trainer.experimental;
    assert!(x.edit_target && x.teacher_contrast == 1.0, "{x:?}");
    assert_eq!(
        f.learner.trainer.target(),
        hindsight_learner::trainer::DistillTarget::Edit
    );
    let label = LearningConfig::from_file(Objective::Distill, f, "/tmp/x").label();
    assert!(
        label.contains("trainer.experimental.edit_target=true"),
        "{label}"
    );
    for (key, name) in [
        (
            "HINDSIGHT_LEARNER__TRAINER__MIN_TARGET_LOGPROB",
            "min_target_logprob",
        ),
        (
            "HINDSIGHT_LEARNER__TRAINER__MIN_FIELD_LOGPROB",
            "min_field_logprob",
        ),
        ("HINDSIGHT_LEARNER__TRAINER__CONFIDENCE", "confidence"),
        ("HINDSIGHT_LEARNER__REPLAY_UNLEARNED", "replay_unlearned"),
        (
            "HINDSIGHT_LEARNER__TRAINER__TEACHER_CONTRAST",
            "teacher_contrast",
        ),
    ] {
        let err = BenchFile::load(None, env(&[(key, "1")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains(&format!("unknown field `{name}`")), "{err}");
    }
    let edit = BenchFile::load(
        None,
        env(&[("HINDSIGHT_LEARNER__TRAINER__DISTILL_TARGET", "edit")]),
    )
    .unwrap_err()
    .to_string();
    assert!(edit.contains("unknown variant `edit`"), "{edit}");
}

/// The changing-rule scenario is read like every other setting, splits the stream between the
/// two SOPs at its event, and refuses a change that is no change or falls outside the run.
#[test]
fn a_rule_change_is_read_from_the_config_and_refused_when_it_cannot_happen() {
    let f = BenchFile::load(
        None,
        env(&[
            ("HINDSIGHT_SCENARIO__EVENTS", "96"),
            ("HINDSIGHT_SCENARIO__RULE_CHANGE__AFTER_EVENTS", "32"),
            (
                "HINDSIGHT_SCENARIO__RULE_CHANGE__RETENTION_AFTER_DAYS",
                "14",
            ),
        ]),
    )
    .unwrap();
    let sc = &f.scenario;
    assert_eq!(
        sc.rule_change,
        Some(RuleChange {
            after_events: 32,
            retention_after_days: 14
        })
    );
    assert_eq!(sc.sop_at(31), Sop::default());
    assert_eq!(sc.sop_at(32).retention_after_days, 14);
    assert_eq!(sc.final_sop().retention_after_days, 14);
    assert_eq!(Scenario::default().final_sop(), Sop::default());
    let label = LearningConfig::from_file(Objective::Default, f, "/tmp").label();
    assert!(label.contains("rule_change"), "{label}");

    for (key, value, events) in [
        ("AFTER_EVENTS", "64", "64"),
        ("AFTER_EVENTS", "0", "64"),
        ("RETENTION_AFTER_DAYS", "30", "96"),
    ] {
        let mut pairs = vec![
            ("HINDSIGHT_SCENARIO__EVENTS", events),
            ("HINDSIGHT_SCENARIO__RULE_CHANGE__AFTER_EVENTS", "32"),
            (
                "HINDSIGHT_SCENARIO__RULE_CHANGE__RETENTION_AFTER_DAYS",
                "14",
            ),
        ];
        let name = format!("HINDSIGHT_SCENARIO__RULE_CHANGE__{key}");
        pairs.retain(|(k, _)| *k != name);
        pairs.push((&name, value));
        let err = BenchFile::load(None, env(&pairs)).unwrap_err().to_string();
        assert!(
            err.contains(&format!("scenario.rule_change.{}", key.to_lowercase())),
            "{key}={value}: {err}"
        );
    }
}
