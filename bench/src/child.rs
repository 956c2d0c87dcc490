//! What a bench's child process (the bench binary re-executed in a role) shares.

/// Resolves when stdin closes: the parent's signal to a child role to stop (dropping the
/// child's stdin pipe), without signals.
pub async fn wait_stdin_closed() {
    let _ = tokio::task::spawn_blocking(|| {
        let mut buf = String::new();
        while std::io::stdin()
            .read_line(&mut buf)
            .map(|n| n > 0)
            .unwrap_or(false)
        {}
    })
    .await;
}
