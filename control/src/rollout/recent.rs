//! The last feedback events the controller read, for the operator page's live feedback view:
//! a bounded ring shared between the controller (which writes) and the admin API (which
//! reads). Only what the controller already reads is kept, and only the newest
//! [`RECENT_FEEDBACK_KEPT`] events, so it costs a few hundred kilobytes at most.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use hindsight_feedback::{Correction, FeedbackRecord, FeedbackTarget, FeedbackValue};
use serde::Serialize;

/// Events kept.
pub const RECENT_FEEDBACK_KEPT: usize = 200;
/// Characters of free text kept per event.
const DETAIL_CHARS: usize = 300;

/// One feedback event as the operator page shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RecentFeedbackEvent {
    pub feedback_id: String,
    /// When the feedback API accepted it, ms since the Unix epoch.
    pub event_time_ms: i64,
    /// `thumbs`, `score`, `comment`, `correction`, `tool_outcome` or `retraction`.
    pub kind: &'static str,
    /// `interaction` or `episode`.
    pub target_kind: &'static str,
    pub target: String,
    /// Thumbs up or down.
    pub thumbs_up: Option<bool>,
    pub score: Option<f64>,
    pub metric: Option<String>,
    pub source: Option<String>,
    /// Route, arm and version of the rollout exposure it concerns, when the controller knows
    /// it (an interaction in a running rollout whose exposure has not matured yet).
    pub route: Option<String>,
    pub arm: Option<String>,
    pub version: Option<String>,
    /// The free text (comment, correction, tool outcome), cut to a few hundred characters.
    /// People write it, so the admin API shows it only to a caller with the admin token.
    pub detail: Option<String>,
}

impl RecentFeedbackEvent {
    /// The page's view of `rec`; `exposure` is (route, arm, version) when known.
    pub fn of(rec: &FeedbackRecord, exposure: Option<(&str, &str, &str)>) -> Self {
        let (target_kind, target) = match &rec.target {
            FeedbackTarget::Interaction(id) => ("interaction", id.to_string()),
            FeedbackTarget::Episode(e) => ("episode", e.clone()),
        };
        let detail = match &rec.value {
            FeedbackValue::Comment(t) => Some(t.clone()),
            FeedbackValue::Correction(Correction::Text(t)) => Some(t.clone()),
            FeedbackValue::Correction(Correction::Message(m)) => serde_json::to_string(m).ok(),
            FeedbackValue::ToolOutcome(o) => serde_json::to_string(o).ok(),
            FeedbackValue::Thumbs(_) | FeedbackValue::Score(_) | FeedbackValue::Retraction => None,
        };
        Self {
            feedback_id: rec.feedback_id.to_string(),
            event_time_ms: rec.event_time_ms,
            kind: rec.value.kind(),
            target_kind,
            target,
            thumbs_up: match rec.value {
                FeedbackValue::Thumbs(up) => Some(up),
                _ => None,
            },
            score: match rec.value {
                FeedbackValue::Score(s) => Some(s),
                _ => None,
            },
            metric: rec.metric.clone(),
            source: rec.source.clone(),
            route: exposure.map(|e| e.0.to_string()),
            arm: exposure.map(|e| e.1.to_string()),
            version: exposure.map(|e| e.2.to_string()),
            detail: detail.map(|d| d.chars().take(DETAIL_CHARS).collect()),
        }
    }
}

/// The ring; clones share it.
#[derive(Debug, Clone, Default)]
pub struct RecentFeedback {
    events: Arc<Mutex<VecDeque<RecentFeedbackEvent>>>,
}

impl RecentFeedback {
    /// An empty ring.
    pub fn new() -> Self {
        Self::default()
    }

    // A panic while holding the lock cannot leave the ring inconsistent (each change is one
    // push or pop), so a poisoned lock is used as it is.
    fn lock(&self) -> MutexGuard<'_, VecDeque<RecentFeedbackEvent>> {
        self.events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds an event, dropping the oldest beyond [`RECENT_FEEDBACK_KEPT`].
    pub fn push(&self, event: RecentFeedbackEvent) {
        let mut events = self.lock();
        if events.len() >= RECENT_FEEDBACK_KEPT {
            events.pop_front();
        }
        events.push_back(event);
    }

    /// Up to `limit` events, newest first.
    pub fn newest(&self, limit: usize) -> Vec<RecentFeedbackEvent> {
        self.lock().iter().rev().take(limit).cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hindsight_feedback::FEEDBACK_SCHEMA;
    use uuid::Uuid;

    fn record(value: FeedbackValue, at_ms: i64) -> FeedbackRecord {
        FeedbackRecord {
            schema: FEEDBACK_SCHEMA.into(),
            feedback_id: Uuid::now_v7(),
            target: FeedbackTarget::Interaction(Uuid::now_v7()),
            value,
            metric: None,
            source: Some("sim".into()),
            rater: None,
            tags: vec![],
            retracts: None,
            event_time_ms: at_ms,
        }
    }

    #[test]
    fn the_ring_keeps_the_newest_events_newest_first() {
        let ring = RecentFeedback::new();
        for i in 0..(RECENT_FEEDBACK_KEPT as i64 + 5) {
            ring.push(RecentFeedbackEvent::of(
                &record(FeedbackValue::Thumbs(i % 2 == 0), i),
                None,
            ));
        }
        let all = ring.newest(usize::MAX);
        assert_eq!(all.len(), RECENT_FEEDBACK_KEPT);
        assert_eq!(all[0].event_time_ms, RECENT_FEEDBACK_KEPT as i64 + 4);
        assert_eq!(all.last().map(|e| e.event_time_ms), Some(5));
        assert_eq!(ring.newest(3).len(), 3);
    }

    #[test]
    fn an_event_shows_its_value_exposure_and_cut_text() {
        let long = "é".repeat(1_000);
        let e = RecentFeedbackEvent::of(
            &record(FeedbackValue::Comment(long), 7),
            Some(("support", "canary", "support@2")),
        );
        assert_eq!(e.kind, "comment");
        assert_eq!(e.detail.as_ref().map(|d| d.chars().count()), Some(300));
        assert_eq!(
            (e.route.as_deref(), e.arm.as_deref(), e.version.as_deref()),
            (Some("support"), Some("canary"), Some("support@2"))
        );
        let t = RecentFeedbackEvent::of(&record(FeedbackValue::Thumbs(false), 8), None);
        assert_eq!((t.thumbs_up, t.detail), (Some(false), None));
    }
}
