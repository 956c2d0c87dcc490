//! External evaluation: eval sets, scorers, pass@k and model comparison against any OpenAI-compatible endpoint.
