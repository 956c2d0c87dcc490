//! The control plane: the adapter registry (versions, files, lineage, status) and publishing a
//! candidate through the external eval gate into serving.

pub mod guard;
pub mod publish;
pub mod registry;
pub mod report;
pub mod rollout;
