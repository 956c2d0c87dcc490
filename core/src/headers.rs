//! The `x-hindsight-*` HTTP header names, in one place for the proxy, the feedback API, the
//! model server, the eval client and the simulated environment.

/// Request: groups the turns of one agent episode.
pub const EPISODE: &str = "x-hindsight-episode";
/// Request: the sticky key for canary assignment.
pub const USER: &str = "x-hindsight-user";
/// Request: which route (deployment) the request belongs to.
pub const ROUTE: &str = "x-hindsight-route";
/// Request: consent opt-out; the proxy forwards the request and records nothing.
pub const NO_LOG: &str = "x-hindsight-no-log";
/// Response: the id of the interaction record the proxy wrote.
pub const INTERACTION_ID: &str = "x-hindsight-interaction-id";
/// Response: the adapter (`name@version`, or the base model) that answered.
pub const ADAPTER: &str = "x-hindsight-adapter";
/// Between the proxy and `hindsight serve`: on a request, asks for the behaviour policy's token
/// ids and log-probs; on the response, carries them (the proxy records and strips it).
pub const BEHAVIOUR: &str = "x-hindsight-behaviour";
/// Feedback webhooks: the signing timestamp (seconds since the epoch).
pub const TIMESTAMP: &str = "x-hindsight-timestamp";
/// Feedback webhooks: `v1=<hex HMAC-SHA256 over "<timestamp>.<body>">`.
pub const SIGNATURE: &str = "x-hindsight-signature";
