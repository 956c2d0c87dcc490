//! Chat templates: the model's own Jinja template (from `tokenizer_config.json` or GGUF
//! `tokenizer.chat_template`) rendered with minijinja configured like HF `transformers`
//! (trim_blocks, lstrip_blocks, Python string/dict methods, `raise_exception`).

use minijinja::{context, Environment, Error, ErrorKind, Value};

use crate::error::{LearnerError, Result};

const TEMPLATE_NAME: &str = "chat";

/// A compiled chat template plus the special tokens it may refer to.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

fn raise_exception(msg: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(fmt)` as HF provides it (Llama 3 templates print today's date). Supports the
/// `%d %m %Y %y %b %B %%` directives, in UTC.
fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

impl ChatTemplate {
    /// Compiles `source`.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| LearnerError::ChatTemplate(e.to_string()))?;
        Ok(Self {
            env,
            source: source.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders OpenAI-style `messages` (a JSON array; `tool_calls`, `tool_call_id`, `name` are
    /// passed through untouched) with optional `tools` (a JSON array of tool definitions).
    pub fn render(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        if !messages.is_array() {
            return Err(LearnerError::InvalidArgument(
                "messages must be a JSON array".into(),
            ));
        }
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| LearnerError::ChatTemplate(e.to_string()))?;
        let tools = match tools {
            Some(t) if !t.is_null() => Value::from_serialize(t),
            _ => Value::from(()),
        };
        tmpl.render(context! {
            messages => Value::from_serialize(messages),
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        })
        .map_err(|e| {
            let mut msg = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            LearnerError::ChatTemplate(msg)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(20_000), (2024, 10, 4));
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let t = ChatTemplate::new(
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok",
            "<s>",
            "</s>",
        )
        .unwrap();
        let err = t
            .render(&json!([{"role": "assistant", "content": "x"}]), None, false)
            .unwrap_err();
        assert!(err.to_string().contains("first must be user"), "{err}");
        assert_eq!(
            t.render(&json!([{"role": "user", "content": "x"}]), None, false)
                .unwrap(),
            "ok"
        );
    }
}
