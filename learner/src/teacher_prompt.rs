//! The hindsight teacher's prompt: the original request plus the model's first answer and the
//! feedback on it, placed in one of a few ways. The learner's self-teacher sees exactly such a
//! prompt; the bench's `baselines` measures which placement lets the model correct itself best.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Where the feedback (and optionally the first answer) goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
#[value(rename_all = "kebab-case")]
pub enum HindsightPlacement {
    /// The first answer as an assistant turn, then the feedback as the next user turn.
    UserTurn,
    /// No first answer; the feedback is appended to the last user message as a note.
    UserNote,
    /// The first answer and the feedback in a hindsight section of the system message.
    System,
    /// Only the feedback in a hindsight section of the system message.
    SystemNoAnswer,
}

impl HindsightPlacement {
    /// All placements, in a stable order.
    pub const ALL: [Self; 4] = [
        Self::UserTurn,
        Self::UserNote,
        Self::System,
        Self::SystemNoAnswer,
    ];

    /// kebab-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::UserTurn => "user-turn",
            Self::UserNote => "user-note",
            Self::System => "system",
            Self::SystemNoAnswer => "system-no-answer",
        }
    }

    /// Whether the first answer is shown.
    pub fn shows_first_answer(self) -> bool {
        matches!(self, Self::UserTurn | Self::System)
    }
}

/// Builds the hindsight conversation from the original `messages` (which end with the user's
/// request), the model's `first_answer` text and the `feedback` text on it.
pub fn hindsight_messages(
    placement: HindsightPlacement,
    messages: &[Value],
    first_answer: &str,
    feedback: &str,
) -> Vec<Value> {
    let mut out = messages.to_vec();
    match placement {
        HindsightPlacement::UserTurn => {
            out.push(json!({"role": "assistant", "content": first_answer}));
            out.push(json!({
                "role": "user",
                "content": format!(
                    "Feedback on your answer: {feedback}\n\nTake this feedback into account and give your corrected final decision."
                ),
            }));
        }
        HindsightPlacement::UserNote => {
            let note = format!(
                "\n\n(Feedback on an earlier answer to this request: {feedback} Take it into account.)"
            );
            let last_user = out
                .iter()
                .rposition(|m| m["role"] == "user" && m["content"].is_string());
            match last_user {
                Some(i) => {
                    let text = format!("{}{note}", out[i]["content"].as_str().unwrap_or_default());
                    out[i]["content"] = Value::String(text);
                }
                None => out.push(json!({"role": "user", "content": note.trim()})),
            }
        }
        HindsightPlacement::System | HindsightPlacement::SystemNoAnswer => {
            let section = if placement == HindsightPlacement::System {
                format!(
                    "\n\n# Hindsight\nAn earlier answer to this request was:\n{first_answer}\nFeedback on that answer: {feedback}\nUse this feedback when you decide."
                )
            } else {
                format!(
                    "\n\n# Hindsight\nFeedback on an earlier answer to this request: {feedback}\nUse this feedback when you decide."
                )
            };
            // Merge into the first system message: several chat templates accept only one.
            match out.first() {
                Some(first) if first["role"] == "system" && first["content"].is_string() => {
                    let text =
                        format!("{}{section}", first["content"].as_str().unwrap_or_default());
                    out[0]["content"] = Value::String(text);
                }
                _ => out.insert(
                    0,
                    json!({"role": "system", "content": section.trim_start()}),
                ),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Vec<Value> {
        vec![
            json!({"role": "system", "content": "You are support."}),
            json!({"role": "user", "content": "My order broke."}),
        ]
    }

    #[test]
    fn user_turn_shows_answer_then_feedback() {
        let m = hindsight_messages(
            HindsightPlacement::UserTurn,
            &base(),
            "{\"a\":1}",
            "Gold is high.",
        );
        assert_eq!(m.len(), 4);
        assert_eq!(m[2]["role"], "assistant");
        assert_eq!(m[2]["content"], "{\"a\":1}");
        assert_eq!(m[3]["role"], "user");
        assert!(m[3]["content"].as_str().unwrap().contains("Gold is high."));
    }

    #[test]
    fn user_note_hides_the_answer() {
        let m = hindsight_messages(
            HindsightPlacement::UserNote,
            &base(),
            "{\"a\":1}",
            "Gold is high.",
        );
        assert_eq!(m.len(), 2);
        let text = m[1]["content"].as_str().unwrap();
        assert!(text.starts_with("My order broke."));
        assert!(text.contains("Gold is high."));
        assert!(!text.contains("{\"a\":1}"));
    }

    #[test]
    fn system_placements_merge_into_the_system_message() {
        let m = hindsight_messages(
            HindsightPlacement::System,
            &base(),
            "{\"a\":1}",
            "Gold is high.",
        );
        assert_eq!(m.len(), 2);
        let sys = m[0]["content"].as_str().unwrap();
        assert!(sys.starts_with("You are support."));
        assert!(sys.contains("{\"a\":1}") && sys.contains("Gold is high."));
        let m = hindsight_messages(
            HindsightPlacement::SystemNoAnswer,
            &base(),
            "{\"a\":1}",
            "Gold is high.",
        );
        let sys = m[0]["content"].as_str().unwrap();
        assert!(!sys.contains("{\"a\":1}") && sys.contains("Gold is high."));
        let m = hindsight_messages(HindsightPlacement::System, &base()[1..], "x", "y");
        assert_eq!(m[0]["role"], "system");
        assert_eq!(m.len(), 2);
    }
}
