//! The signal: record schemas, the Kafka interaction/feedback log with disk spill, webhook ingestion and the join into episodes.
