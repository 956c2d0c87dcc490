//! Eval sets: one JSON object per line (JSONL), each an OpenAI-style request plus the expected
//! outcome and the scorer that judges it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::error::EvalError;

/// How an item's answer is judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum ScorerKind {
    /// The answer's JSON object (inside `<final_output>…</final_output>`, or the bare JSON
    /// when the request used `response_format`) must have every expected field equal.
    JsonExact,
    /// Same parsing as `json_exact`; the item's score is the share of expected fields equal.
    FieldAccuracy,
    /// `expected` is a regular expression that must match somewhere in the answer text.
    Regex,
    /// `expected` is a string (or an array of strings) that must all occur in the answer text.
    Contains,
}

impl ScorerKind {
    /// Whether the scorer parses a JSON object out of the answer.
    pub fn is_json(self) -> bool {
        matches!(self, Self::JsonExact | Self::FieldAccuracy)
    }

    /// The name used in JSON and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::JsonExact => "json_exact",
            Self::FieldAccuracy => "field_accuracy",
            Self::Regex => "regex",
            Self::Contains => "contains",
        }
    }
}

fn default_scorer() -> ScorerKind {
    ScorerKind::JsonExact
}

/// One evaluation item: what is sent to the model and what counts as right.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalItem {
    /// Stable item id (unique within the set); used to pair items when comparing two models.
    pub id: String,
    /// OpenAI chat messages, sent unchanged.
    pub messages: Vec<Value>,
    /// OpenAI tool definitions, sent unchanged when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Value>>,
    /// OpenAI `response_format`, sent unchanged when present. When set, a bare JSON answer
    /// (what constrained decoding returns) is accepted by the JSON scorers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<Value>,
    /// Replayed tool results for multi-turn items: tool name → canonical JSON of the arguments
    /// (keys sorted, no spaces) → result. A tool call not in the table gets an error result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_replay: Option<BTreeMap<String, BTreeMap<String, Value>>>,
    /// The scorer (default `json_exact`).
    #[serde(default = "default_scorer")]
    pub scorer: ScorerKind,
    /// Expected outcome: a JSON object for the JSON scorers, a pattern for `regex`, a string or
    /// array of strings for `contains`.
    pub expected: Value,
    /// Free-form data carried into the results (e.g. which hidden rules decide the item).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
}

impl EvalItem {
    /// Checks that `expected` has the shape the scorer needs.
    pub fn validate(&self, line: usize) -> Result<(), EvalError> {
        let invalid = |reason: String| EvalError::InvalidItem { line, reason };
        if self.id.is_empty() {
            return Err(invalid("`id` must not be empty".into()));
        }
        if self.messages.is_empty() {
            return Err(invalid(format!(
                "item {}: `messages` must not be empty",
                self.id
            )));
        }
        match self.scorer {
            ScorerKind::JsonExact | ScorerKind::FieldAccuracy => match &self.expected {
                Value::Object(map) if !map.is_empty() => Ok(()),
                _ => Err(invalid(format!(
                    "item {}: scorer {} needs `expected` to be a non-empty JSON object",
                    self.id,
                    self.scorer.as_str()
                ))),
            },
            ScorerKind::Regex => match &self.expected {
                Value::String(pattern) => regex::Regex::new(pattern).map(|_| ()).map_err(|e| {
                    invalid(format!("item {}: `expected` is not a valid regex: {e}", self.id))
                }),
                _ => Err(invalid(format!(
                    "item {}: scorer regex needs `expected` to be a string pattern",
                    self.id
                ))),
            },
            ScorerKind::Contains => match &self.expected {
                Value::String(_) => Ok(()),
                Value::Array(parts) if parts.iter().all(Value::is_string) && !parts.is_empty() => {
                    Ok(())
                }
                _ => Err(invalid(format!(
                    "item {}: scorer contains needs `expected` to be a string or an array of strings",
                    self.id
                ))),
            },
        }
    }
}

/// A loaded eval set with its identity (path and sha256 of the exact bytes).
#[derive(Debug, Clone)]
pub struct EvalSet {
    /// Short name (the file stem, or what the caller chose).
    pub name: String,
    /// Where it was read from, if from a file.
    pub path: Option<PathBuf>,
    /// Lowercase hex sha256 of the JSONL bytes (for in-memory sets: of their serialization).
    pub sha256: String,
    /// The items in file order.
    pub items: Vec<EvalItem>,
}

impl EvalSet {
    /// Reads and validates a JSONL eval set. Blank lines and lines starting with `//` are skipped.
    pub fn load(path: &Path) -> Result<Self, EvalError> {
        let bytes = std::fs::read(path).map_err(|source| EvalError::ReadSet {
            path: path.to_path_buf(),
            source,
        })?;
        let text = String::from_utf8(bytes.clone()).map_err(|e| EvalError::InvalidItem {
            line: 0,
            reason: format!("file is not UTF-8: {e}"),
        })?;
        let items = parse_jsonl(&text)?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "eval".to_string());
        Ok(Self {
            name,
            path: Some(path.to_path_buf()),
            sha256: hex::encode(Sha256::digest(&bytes)),
            items,
        })
    }

    /// Builds a set from items in memory (validated; the hash is over their JSONL form).
    pub fn from_items(name: impl Into<String>, items: Vec<EvalItem>) -> Result<Self, EvalError> {
        let text = to_jsonl(&items)?;
        let items = parse_jsonl(&text)?;
        Ok(Self {
            name: name.into(),
            path: None,
            sha256: hex::encode(Sha256::digest(text.as_bytes())),
            items,
        })
    }

    /// Keeps only the first `n` items (the hash still names the full file).
    pub fn truncate(&mut self, n: usize) {
        self.items.truncate(n);
    }
}

/// Serializes items as JSONL (one object per line, trailing newline).
pub fn to_jsonl(items: &[EvalItem]) -> Result<String, EvalError> {
    let mut out = String::new();
    for item in items {
        out.push_str(&serde_json::to_string(item)?);
        out.push('\n');
    }
    Ok(out)
}

fn parse_jsonl(text: &str) -> Result<Vec<EvalItem>, EvalError> {
    let mut items = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with("//") {
            continue;
        }
        let item: EvalItem = serde_json::from_str(trimmed).map_err(|e| EvalError::InvalidItem {
            line: line_no,
            reason: e.to_string(),
        })?;
        item.validate(line_no)?;
        if !seen.insert(item.id.clone()) {
            return Err(EvalError::InvalidItem {
                line: line_no,
                reason: format!("duplicate id {}", item.id),
            });
        }
        items.push(item);
    }
    if items.is_empty() {
        return Err(EvalError::EmptySet);
    }
    Ok(items)
}

/// Canonical form of tool-call arguments used as the `tool_replay` key: the arguments parsed
/// as JSON and re-serialized with sorted keys; unparseable arguments are used verbatim.
pub fn canonical_arguments(arguments: &str) -> String {
    match serde_json::from_str::<Value>(arguments) {
        // serde_json's default map is a BTreeMap, so serialization sorts keys.
        Ok(value) => value.to_string(),
        Err(_) => arguments.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_items_and_rejects_bad_shapes() {
        let good = r#"{"id":"a","messages":[{"role":"user","content":"hi"}],"expected":{"x":1}}
// a comment

{"id":"b","messages":[{"role":"user","content":"hi"}],"scorer":"regex","expected":"^h"}"#;
        let items = parse_jsonl(good).unwrap();
        assert_eq!(items.len(), 2);
        assert_eq!(items[0].scorer, ScorerKind::JsonExact);
        assert_eq!(items[1].scorer, ScorerKind::Regex);

        let bad_regex = r#"{"id":"a","messages":[{"role":"user","content":"hi"}],"scorer":"regex","expected":"("}"#;
        assert!(matches!(
            parse_jsonl(bad_regex),
            Err(EvalError::InvalidItem { line: 1, .. })
        ));
        let bad_expected =
            r#"{"id":"a","messages":[{"role":"user","content":"hi"}],"expected":"x"}"#;
        assert!(parse_jsonl(bad_expected).is_err());
        let unknown_field =
            r#"{"id":"a","messages":[{"role":"user","content":"hi"}],"expected":{"x":1},"oops":1}"#;
        assert!(parse_jsonl(unknown_field).is_err());
        let dup = r#"{"id":"a","messages":[{"role":"user","content":"hi"}],"expected":{"x":1}}
{"id":"a","messages":[{"role":"user","content":"hi"}],"expected":{"x":1}}"#;
        assert!(matches!(
            parse_jsonl(dup),
            Err(EvalError::InvalidItem { line: 2, .. })
        ));
        assert!(matches!(parse_jsonl("\n\n"), Err(EvalError::EmptySet)));
    }

    #[test]
    fn canonical_arguments_sort_keys() {
        assert_eq!(
            canonical_arguments(r#"{ "b": 1, "a": "x" }"#),
            r#"{"a":"x","b":1}"#
        );
        assert_eq!(canonical_arguments("not json"), "not json");
    }
}
