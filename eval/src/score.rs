//! Scorers: turn one model answer into a score against an item's expected outcome.
//!
//! JSON answers are read from the LAST `<final_output>…</final_output>` block (an agent that
//! drafts and then revises is judged on its final word; only one block is ever scored, so
//! several blocks cannot raise a score). When the request used `response_format`, a bare JSON
//! answer (what constrained decoding returns) is accepted too. Anything else — prose without
//! the block, invalid JSON, a non-object — scores 0 with the reason counted.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::set::ScorerKind;

const OPEN_TAG: &str = "<final_output>";
const CLOSE_TAG: &str = "</final_output>";
/// Absolute tolerance when comparing numbers (amounts are cents: far coarser than this).
const NUMBER_TOLERANCE: f64 = 1e-6;

/// Why an answer could not be scored (it scores 0, and the reason is counted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Unparseable {
    /// The model returned no text.
    EmptyResponse,
    /// No `<final_output>` block, and a bare JSON answer was not allowed or not valid.
    NoFinalOutput,
    /// A `<final_output>` opened but never closed.
    UnclosedFinalOutput,
    /// The block (or bare answer) is not valid JSON.
    InvalidJson,
    /// Valid JSON, but not an object.
    NotAnObject,
    /// The request failed (after retries), so there is no answer.
    RequestFailed,
    /// The model kept calling tools past the turn limit without answering.
    ToolTurnLimit,
}

impl Unparseable {
    /// snake_case name, as in the results JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::EmptyResponse => "empty_response",
            Self::NoFinalOutput => "no_final_output",
            Self::UnclosedFinalOutput => "unclosed_final_output",
            Self::InvalidJson => "invalid_json",
            Self::NotAnObject => "not_an_object",
            Self::RequestFailed => "request_failed",
            Self::ToolTurnLimit => "tool_turn_limit",
        }
    }
}

/// The judgement of one answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Score {
    /// Whether the answer is fully right (every expected field equal; regex matched; all
    /// strings contained).
    pub passed: bool,
    /// The scorer's number in [0, 1]: 1/0 for `json_exact`, `regex`, `contains`; the share of
    /// fields equal for `field_accuracy`.
    pub value: f64,
    /// Share of expected fields equal (JSON scorers only; 0 when unparseable).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field_accuracy: Option<f64>,
    /// Per expected field: equal or not (JSON scorers with a parsed answer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fields: Option<BTreeMap<String, bool>>,
    /// Why the answer could not be scored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unparseable: Option<Unparseable>,
    /// The JSON object that was scored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<Value>,
}

impl Score {
    /// A zero score for an answer that could not be scored.
    pub fn unparseable(scorer: ScorerKind, reason: Unparseable) -> Self {
        Self {
            passed: false,
            value: 0.0,
            field_accuracy: scorer.is_json().then_some(0.0),
            fields: None,
            unparseable: Some(reason),
            answer: None,
        }
    }
}

/// Scores `content` (the assistant's final text) against `expected`.
///
/// `bare_json_allowed` should be true when the request carried a `response_format`.
/// `expected` must already be validated for the scorer (see `EvalItem::validate`); a shape
/// mismatch scores 0 rather than failing.
pub fn score_answer(
    scorer: ScorerKind,
    expected: &Value,
    content: &str,
    bare_json_allowed: bool,
) -> Score {
    match scorer {
        ScorerKind::JsonExact | ScorerKind::FieldAccuracy => {
            let Value::Object(expected) = expected else {
                return Score::unparseable(scorer, Unparseable::NotAnObject);
            };
            match extract_json_answer(content, bare_json_allowed) {
                Ok(answer) => score_json(scorer, expected, answer),
                Err(reason) => Score::unparseable(scorer, reason),
            }
        }
        ScorerKind::Regex => {
            if content.trim().is_empty() {
                return Score::unparseable(scorer, Unparseable::EmptyResponse);
            }
            let passed = match expected {
                Value::String(pattern) => regex::Regex::new(pattern)
                    .map(|re| re.is_match(content))
                    .unwrap_or(false),
                _ => false,
            };
            binary(passed)
        }
        ScorerKind::Contains => {
            if content.trim().is_empty() {
                return Score::unparseable(scorer, Unparseable::EmptyResponse);
            }
            let passed = match expected {
                Value::String(needle) => content.contains(needle.as_str()),
                Value::Array(needles) => needles
                    .iter()
                    .all(|n| n.as_str().is_some_and(|n| content.contains(n))),
                _ => false,
            };
            binary(passed)
        }
    }
}

fn binary(passed: bool) -> Score {
    Score {
        passed,
        value: if passed { 1.0 } else { 0.0 },
        field_accuracy: None,
        fields: None,
        unparseable: None,
        answer: None,
    }
}

fn score_json(
    scorer: ScorerKind,
    expected: &Map<String, Value>,
    answer: Map<String, Value>,
) -> Score {
    let mut fields = BTreeMap::new();
    for (name, want) in expected {
        // A missing field equals nothing, not even an expected null: absent is not an answer.
        let ok = answer.get(name).is_some_and(|got| values_equal(want, got));
        fields.insert(name.clone(), ok);
    }
    let correct = fields.values().filter(|ok| **ok).count();
    let accuracy = if fields.is_empty() {
        0.0
    } else {
        correct as f64 / fields.len() as f64
    };
    let passed = !fields.is_empty() && correct == fields.len();
    Score {
        passed,
        value: match scorer {
            ScorerKind::FieldAccuracy => accuracy,
            _ => {
                if passed {
                    1.0
                } else {
                    0.0
                }
            }
        },
        field_accuracy: Some(accuracy),
        fields: Some(fields),
        unparseable: None,
        answer: Some(Value::Object(answer)),
    }
}

/// Equality for scoring: types must match (`"25"` is not `25`, `"true"` is not `true`),
/// numbers compare within a tiny tolerance (`25` equals `25.0`), objects and arrays compare
/// element-wise and strictly (no extra keys inside nested objects).
pub fn values_equal(want: &Value, got: &Value) -> bool {
    match (want, got) {
        (Value::Number(a), Value::Number(b)) => match (a.as_f64(), b.as_f64()) {
            (Some(a), Some(b)) => (a - b).abs() <= NUMBER_TOLERANCE,
            _ => a == b,
        },
        (Value::Array(a), Value::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| values_equal(x, y))
        }
        (Value::Object(a), Value::Object(b)) => {
            a.len() == b.len()
                && a.iter()
                    .all(|(k, v)| b.get(k).is_some_and(|w| values_equal(v, w)))
        }
        _ => want == got,
    }
}

/// Finds the answer's JSON object: the bare answer when allowed and valid, else the last
/// `<final_output>` block.
pub fn extract_json_answer(
    content: &str,
    bare_json_allowed: bool,
) -> Result<Map<String, Value>, Unparseable> {
    let trimmed = content.trim();
    if trimmed.is_empty() {
        return Err(Unparseable::EmptyResponse);
    }
    if bare_json_allowed {
        if let Ok(value) = serde_json::from_str::<Value>(strip_code_fence(trimmed)) {
            return match value {
                Value::Object(map) => Ok(map),
                _ => Err(Unparseable::NotAnObject),
            };
        }
    }
    match last_final_output_block(content) {
        Some(Ok(block)) => parse_object(block),
        Some(Err(reason)) => Err(reason),
        None if bare_json_allowed => {
            // Neither valid bare JSON nor a block: say which is closer.
            if trimmed.starts_with('{') || trimmed.starts_with("```") {
                Err(Unparseable::InvalidJson)
            } else {
                Err(Unparseable::NoFinalOutput)
            }
        }
        None => Err(Unparseable::NoFinalOutput),
    }
}

/// The text of the last complete `<final_output>` block; `Err(Unclosed)` when the last opening
/// tag is never closed and no complete block exists; `None` when there is no tag at all.
fn last_final_output_block(content: &str) -> Option<Result<&str, Unparseable>> {
    let mut last = None;
    let mut rest = content;
    let mut offset = 0;
    let mut unclosed = false;
    while let Some(start) = rest.find(OPEN_TAG) {
        let body_start = start + OPEN_TAG.len();
        match rest[body_start..].find(CLOSE_TAG) {
            Some(len) => {
                last = Some((offset + body_start, offset + body_start + len));
                let next = body_start + len + CLOSE_TAG.len();
                offset += next;
                rest = &rest[next..];
            }
            None => {
                unclosed = true;
                break;
            }
        }
    }
    match (last, unclosed) {
        (Some((a, b)), _) => Some(Ok(&content[a..b])),
        (None, true) => Some(Err(Unparseable::UnclosedFinalOutput)),
        (None, false) => None,
    }
}

fn parse_object(block: &str) -> Result<Map<String, Value>, Unparseable> {
    let inner = strip_code_fence(block.trim());
    if inner.is_empty() {
        return Err(Unparseable::InvalidJson);
    }
    match serde_json::from_str::<Value>(inner) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(Unparseable::NotAnObject),
        Err(_) => Err(Unparseable::InvalidJson),
    }
}

/// Removes one surrounding Markdown code fence (```json … ```), which models add out of habit.
fn strip_code_fence(text: &str) -> &str {
    let Some(rest) = text.strip_prefix("```") else {
        return text;
    };
    let Some(body) = rest.strip_suffix("```") else {
        return text;
    };
    // Drop the info string (e.g. `json`) on the first line.
    match body.find('\n') {
        Some(nl) if !body[..nl].trim_start().starts_with('{') => body[nl + 1..].trim(),
        _ => body.trim(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn expected() -> Value {
        json!({"department": "billing", "priority": "high", "refund": true, "refund_amount": 25.5})
    }

    fn exact(content: &str, bare: bool) -> Score {
        score_answer(ScorerKind::JsonExact, &expected(), content, bare)
    }

    const RIGHT: &str =
        r#"{"department": "billing", "priority": "high", "refund": true, "refund_amount": 25.5}"#;

    #[test]
    fn exact_match_inside_final_output() {
        let s = exact(&format!("<final_output>{RIGHT}</final_output>"), false);
        assert!(s.passed);
        assert_eq!(s.value, 1.0);
        assert_eq!(s.field_accuracy, Some(1.0));
    }

    #[test]
    fn prose_around_the_block_is_fine_but_prose_around_bare_json_is_not() {
        let s = exact(
            &format!("Sure! Here is my decision:\n<final_output>\n{RIGHT}\n</final_output>\nHope this helps."),
            false,
        );
        assert!(s.passed);
        let s = exact(&format!("Here is my decision: {RIGHT} Thanks!"), false);
        assert_eq!(s.unparseable, Some(Unparseable::NoFinalOutput));
        assert_eq!(s.value, 0.0);
        // Even with response_format, prose around bare JSON is not the constrained answer.
        let s = exact(&format!("Here is my decision: {RIGHT} Thanks!"), true);
        assert_eq!(s.unparseable, Some(Unparseable::NoFinalOutput));
    }

    #[test]
    fn bare_json_only_counts_when_response_format_was_used() {
        assert!(exact(RIGHT, true).passed);
        assert!(exact(&format!("  \n{RIGHT}\n"), true).passed);
        let s = exact(RIGHT, false);
        assert!(!s.passed);
        assert_eq!(s.unparseable, Some(Unparseable::NoFinalOutput));
    }

    #[test]
    fn several_blocks_the_last_one_is_scored() {
        let wrong = RIGHT.replace("billing", "shipping");
        let s = exact(
            &format!("<final_output>{wrong}</final_output> wait, correction: <final_output>{RIGHT}</final_output>"),
            false,
        );
        assert!(s.passed);
        let s = exact(
            &format!("<final_output>{RIGHT}</final_output><final_output>{wrong}</final_output>"),
            false,
        );
        assert!(!s.passed);
        assert_eq!(s.field_accuracy, Some(0.75));
        // A complete block followed by an unclosed one: the complete one is scored.
        let s = exact(
            &format!("<final_output>{RIGHT}</final_output><final_output>{{\"department\":"),
            false,
        );
        assert!(s.passed);
    }

    #[test]
    fn extra_fields_are_ignored_missing_fields_are_wrong() {
        let s = exact(
            r#"<final_output>{"department": "billing", "priority": "high", "refund": true, "refund_amount": 25.5, "note": "sorry!"}</final_output>"#,
            false,
        );
        assert!(s.passed);
        let s = exact(
            r#"<final_output>{"department": "billing", "priority": "high", "refund": true}</final_output>"#,
            false,
        );
        assert!(!s.passed);
        assert_eq!(s.field_accuracy, Some(0.75));
        assert!(!s.fields.unwrap()["refund_amount"]);
    }

    #[test]
    fn wrong_types_are_wrong() {
        let s = exact(
            r#"<final_output>{"department": "billing", "priority": "high", "refund": "true", "refund_amount": "25.5"}</final_output>"#,
            false,
        );
        assert!(!s.passed);
        assert_eq!(s.field_accuracy, Some(0.5));
        // 25.50 written as an integer-looking float still equals; 25 vs 25.0 too.
        let s = score_answer(
            ScorerKind::JsonExact,
            &json!({"n": 25}),
            r#"<final_output>{"n": 25.0}</final_output>"#,
            false,
        );
        assert!(s.passed);
        let s = score_answer(
            ScorerKind::JsonExact,
            &json!({"n": 25.5}),
            r#"<final_output>{"n": 25.51}</final_output>"#,
            false,
        );
        assert!(!s.passed);
    }

    #[test]
    fn unparseable_reasons() {
        assert_eq!(
            exact("", false).unparseable,
            Some(Unparseable::EmptyResponse)
        );
        assert_eq!(
            exact("   ", true).unparseable,
            Some(Unparseable::EmptyResponse)
        );
        assert_eq!(
            exact("<final_output>{\"department\": \"billing\"", false).unparseable,
            Some(Unparseable::UnclosedFinalOutput)
        );
        assert_eq!(
            exact("<final_output>{department: billing}</final_output>", false).unparseable,
            Some(Unparseable::InvalidJson)
        );
        assert_eq!(
            exact("<final_output>[1, 2]</final_output>", false).unparseable,
            Some(Unparseable::NotAnObject)
        );
        assert_eq!(
            exact("[1, 2]", true).unparseable,
            Some(Unparseable::NotAnObject)
        );
        assert_eq!(
            exact("{\"department\": ", true).unparseable,
            Some(Unparseable::InvalidJson)
        );
        assert_eq!(
            exact("<final_output></final_output>", false).unparseable,
            Some(Unparseable::InvalidJson)
        );
        let s = exact("no idea", false);
        assert_eq!(s.value, 0.0);
        assert_eq!(s.field_accuracy, Some(0.0));
    }

    #[test]
    fn code_fences_inside_the_block_are_tolerated() {
        let s = exact(
            &format!("<final_output>\n```json\n{RIGHT}\n```\n</final_output>"),
            false,
        );
        assert!(s.passed);
        let s = exact(&format!("```json\n{RIGHT}\n```"), true);
        assert!(s.passed);
    }

    #[test]
    fn field_accuracy_scorer_gives_partial_credit() {
        let s = score_answer(
            ScorerKind::FieldAccuracy,
            &expected(),
            r#"{"department": "billing", "priority": "low", "refund": false, "refund_amount": 25.5}"#,
            true,
        );
        assert!(!s.passed);
        assert_eq!(s.value, 0.5);
    }

    #[test]
    fn nested_values_compare_strictly() {
        assert!(values_equal(
            &json!({"a": [1, {"b": 2}]}),
            &json!({"a": [1.0, {"b": 2}]})
        ));
        assert!(!values_equal(
            &json!({"a": [1, {"b": 2}]}),
            &json!({"a": [1, {"b": 2, "c": 3}]})
        ));
        assert!(!values_equal(&json!([1, 2]), &json!([2, 1])));
        assert!(!values_equal(&json!(null), &json!(0)));
    }

    #[test]
    fn regex_and_contains() {
        let re = json!(r"refund of \$\d+\.\d{2}");
        assert!(
            score_answer(
                ScorerKind::Regex,
                &re,
                "We issued a refund of $25.50.",
                false
            )
            .passed
        );
        assert!(!score_answer(ScorerKind::Regex, &re, "We issued a refund.", false).passed);
        assert_eq!(
            score_answer(ScorerKind::Regex, &re, "", false).unparseable,
            Some(Unparseable::EmptyResponse)
        );
        assert!(score_answer(ScorerKind::Contains, &json!("Paris"), "It is Paris.", false).passed);
        assert!(!score_answer(ScorerKind::Contains, &json!("Paris"), "It is paris.", false).passed);
        let all = json!(["billing", "refund"]);
        assert!(score_answer(ScorerKind::Contains, &all, "billing will refund you", false).passed);
        assert!(!score_answer(ScorerKind::Contains, &all, "billing will call you", false).passed);
    }
}
