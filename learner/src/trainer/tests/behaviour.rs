//! The policy's log-probs of a logged answer on the behaviour's footing (behaviour.rs): checked
//! against the model crate's own renormalised log-prob of a guided choice.

use super::*;
use crate::example::Sampling;
use crate::trainer::config::BehaviourLogprobs;

#[test]
fn the_policy_view_is_the_tempered_grammar_renormalised_distribution() {
    let (dec, rf, _) = guided();
    let mut tr = Trainer::new(model(), weights(0.0, 0.0, 0.0, 1.0), "p").unwrap();
    let mut ex = example(1, false, false, Some(true));
    // `{"k": "a"}` and the end of turn.
    ex.answer_ids = vec![0, 2, 6, 2, 3, 4, 2, 7, 2, 1, 31];
    ex.answer_format = Some(rf.clone());
    ex.sampling = Sampling {
        temperature: 0.7,
        top_p: 1.0,
        unknown_grammar: false,
    };
    ex.behaviour_logprobs = Some(vec![-1.0; ex.answer_ids.len()]);
    let pass = tr.policy_pass(&ex.context_ids, &ex.answer_ids).unwrap();
    assert!(
        tr.behaviour_view(&ex, &pass.logits, &pass.logprobs)
            .is_err(),
        "following the grammar without the vocabulary is an error, not a silent fallback"
    );
    tr.set_decoding(dec.clone());
    let view = tr
        .behaviour_view(&ex, &pass.logits, &pass.logprobs)
        .unwrap();
    assert!(view.comparable.iter().all(|c| *c));
    let got: Vec<f32> = view.logprobs.to_vec1().unwrap();
    let rows: Vec<Vec<f32>> = pass.logits.to_vec2().unwrap();
    let node = response_format_grammar(&rf).unwrap().unwrap();
    let mut st = JsonState::new(&node);
    for (t, (row, &y)) in rows.iter().zip(&ex.answer_ids).enumerate() {
        // The end of the document is forced once the grammar is finished.
        let want = if st.finished() {
            0.0
        } else {
            let scaled: Vec<f32> = row.iter().map(|l| l / 0.7).collect();
            let lp = choice_logprob(&scaled, y, &allowed_by_grammar(&st, &dec.vocab));
            assert!(st.feed_str(dec.vocab[y as usize].as_deref().unwrap()));
            lp
        };
        assert!(
            (f64::from(got[t]) - want).abs() < 1e-5,
            "position {t}: {} vs {want}",
            got[t]
        );
    }
    // Forced choices (the structure around the value) are certain under the grammar.
    assert_eq!(got[0], 0.0, "the document must open with {{");

    // What the learner cannot rebuild counts as on-policy, on the raw log-probs: a grammar
    // it does not know (a forced tool call), greedy decoding; and `raw` compares the raw ones.
    let raw: Vec<f32> = pass.logprobs.to_vec1().unwrap();
    for (s, mode, comparable) in [
        (
            Sampling {
                unknown_grammar: true,
                ..ex.sampling
            },
            BehaviourLogprobs::Sampled,
            false,
        ),
        (
            Sampling {
                temperature: 0.0,
                ..ex.sampling
            },
            BehaviourLogprobs::Sampled,
            false,
        ),
        (ex.sampling, BehaviourLogprobs::Raw, true),
    ] {
        let mut e = ex.clone();
        e.sampling = s;
        tr.cfg.behaviour_logprobs = mode;
        let v = tr.behaviour_view(&e, &pass.logits, &pass.logprobs).unwrap();
        assert_eq!(v.logprobs.to_vec1::<f32>().unwrap(), raw, "{s:?} {mode:?}");
        assert!(
            v.comparable.iter().all(|c| *c == comparable),
            "{s:?} {mode:?}"
        );
    }
}

/// An answer that leaves its grammar (a token the grammar does not allow) is followed up to
/// there; the rest keeps the raw log-probs and is not compared.
#[test]
fn an_answer_that_leaves_its_grammar_is_compared_only_up_to_there() {
    let (dec, rf, _) = guided();
    let mut tr = Trainer::new(model(), weights(0.0, 0.0, 0.0, 1.0), "p").unwrap();
    tr.set_decoding(dec);
    let mut ex = example(1, false, false, Some(true));
    // `{"k": "z` — 'z' has no text in the test vocabulary (token 20), then `"}`.
    ex.answer_ids = vec![0, 2, 6, 2, 3, 4, 2, 20, 2, 1, 31];
    ex.answer_format = Some(rf);
    ex.sampling.temperature = 0.7;
    ex.behaviour_logprobs = Some(vec![-1.0; ex.answer_ids.len()]);
    let pass = tr.policy_pass(&ex.context_ids, &ex.answer_ids).unwrap();
    let view = tr
        .behaviour_view(&ex, &pass.logits, &pass.logprobs)
        .unwrap();
    let known: Vec<bool> = (0..ex.answer_ids.len()).map(|t| t < 7).collect();
    assert_eq!(view.comparable, known);
    let raw: Vec<f32> = pass.logprobs.to_vec1().unwrap();
    let got: Vec<f32> = view.logprobs.to_vec1().unwrap();
    assert_eq!(got[7..], raw[7..]);
}
