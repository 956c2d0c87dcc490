//! Text views of the adapter registry, for `hindsight adapters list|show|diff` and anyone who
//! wants the same tables: every function returns the text (a table, or JSON when asked).

use serde_json::Value;

use crate::registry::{diff, differing_fields, json_err, Registry, RegistryError, VersionEntry};

/// Every version (of one adapter, or of all), oldest first: a table, or JSON lines.
pub async fn list(reg: &Registry, name: Option<&str>, json: bool) -> Result<String, RegistryError> {
    let entries = reg.list(name).await?;
    if json {
        let mut s = String::new();
        for e in &entries {
            s.push_str(&serde_json::to_string(e).map_err(json_err("registry entry"))?);
            s.push('\n');
        }
        Ok(s)
    } else if entries.is_empty() {
        Ok(format!(
            "No adapter versions under {} (check --redis-url / --key-prefix).\n",
            reg.key_prefix()
        ))
    } else {
        Ok(render_table(&entries, name.is_none()))
    }
}

/// One version in full: readable, or the raw JSON entry.
pub async fn show(
    reg: &Registry,
    name: &str,
    version: u64,
    json: bool,
) -> Result<String, RegistryError> {
    let entry = get(reg, name, version).await?;
    if json {
        let mut s = serde_json::to_string_pretty(&entry).map_err(json_err("registry entry"))?;
        s.push('\n');
        Ok(s)
    } else {
        Ok(render_entry(&entry))
    }
}

/// Two versions compared: entry fields, LoRA settings, per-module weight changes.
pub async fn compare(
    reg: &Registry,
    name: &str,
    a: u64,
    b: u64,
    json: bool,
) -> Result<String, RegistryError> {
    let (ea, eb) = (get(reg, name, a).await?, get(reg, name, b).await?);
    let d = diff(&ea, &eb)?;
    if json {
        let mut s = serde_json::to_string_pretty(&d).map_err(json_err("diff"))?;
        s.push('\n');
        Ok(s)
    } else {
        Ok(render_diff(&d))
    }
}

async fn get(reg: &Registry, name: &str, version: u64) -> Result<VersionEntry, RegistryError> {
    reg.get(name, version)
        .await?
        .ok_or_else(|| RegistryError::NotFound {
            name: name.to_string(),
            version,
        })
}

/// `83.3%→16.7%` (live → candidate exact match) from a gate result.
fn eval_cell(eval: Option<&Value>) -> String {
    let Some(e) = eval else { return "-".into() };
    let em = |side: &str| {
        e.get(side)
            .and_then(|s| s.get("exact_match"))
            .and_then(Value::as_f64)
    };
    match (em("live"), em("candidate")) {
        (Some(l), Some(c)) => format!("{:.1}%→{:.1}%", l * 100.0, c * 100.0),
        _ => "?".into(),
    }
}

pub(crate) fn render_table(entries: &[VersionEntry], with_name: bool) -> String {
    let mut rows: Vec<Vec<String>> = vec![];
    let mut header = vec![];
    if with_name {
        header.push("NAME");
    }
    header.extend([
        "VERSION",
        "STATUS",
        "PARENT",
        "EXAMPLES",
        "TOKENS",
        "EVAL live→cand",
        "CREATED",
        "NOTE",
    ]);
    rows.push(header.into_iter().map(String::from).collect());
    for e in entries {
        let mut row = vec![];
        if with_name {
            row.push(e.name.clone());
        }
        row.extend([
            format!("v{}", e.version),
            e.status.to_string(),
            e.parent
                .map(|p| format!("v{p}"))
                .unwrap_or_else(|| "-".into()),
            e.examples.to_string(),
            e.tokens.to_string(),
            eval_cell(e.eval.as_ref()),
            format_time_ms(e.created_at_ms),
            e.note.clone().unwrap_or_default(),
        ]);
        rows.push(row);
    }
    render_rows(&rows)
}

fn render_rows(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let mut line = String::new();
        for (c, cell) in r.iter().enumerate() {
            if c + 1 == r.len() {
                line.push_str(cell);
            } else {
                line.push_str(cell);
                line.extend(std::iter::repeat_n(
                    ' ',
                    widths[c] - cell.chars().count() + 2,
                ));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

pub(crate) fn render_entry(e: &VersionEntry) -> String {
    let mut rows: Vec<Vec<String>> = vec![
        vec!["name".into(), e.name.clone()],
        vec!["version".into(), e.version.to_string()],
        vec!["status".into(), e.status.to_string()],
        vec![
            "parent".into(),
            e.parent
                .map(|p| p.to_string())
                .unwrap_or_else(|| "-".into()),
        ],
        vec!["base model".into(), e.base_model.clone()],
        vec!["base model sha256".into(), e.base_model_sha256.clone()],
        vec!["path".into(), e.path.display().to_string()],
    ];
    for (f, h) in &e.files_sha256 {
        rows.push(vec![format!("sha256 {f}"), h.clone()]);
    }
    rows.push(vec!["examples".into(), e.examples.to_string()]);
    rows.push(vec!["tokens".into(), e.tokens.to_string()]);
    for o in &e.offsets {
        rows.push(vec![
            "offsets".into(),
            format!("{}[{}] {}..{}", o.topic, o.partition, o.from, o.to),
        ]);
    }
    rows.push(vec!["created".into(), format_time_ms(e.created_at_ms)]);
    rows.push(vec!["updated".into(), format_time_ms(e.updated_at_ms)]);
    rows.push(vec![
        "note".into(),
        e.note.clone().unwrap_or_else(|| "-".into()),
    ]);
    if let Some(ev) = &e.eval {
        rows.push(vec!["eval live→candidate".into(), eval_cell(Some(ev))]);
        for k in ["verdict", "margin", "delta", "items"] {
            if let Some(v) = ev.get(k) {
                rows.push(vec![format!("eval {k}"), compact(v)]);
            }
        }
    }
    rows.push(vec!["training config".into(), compact(&e.training_config)]);
    render_rows(&rows)
}

fn compact(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Modules printed by the readable diff (the rest are in `--json`).
const DIFF_TOP_MODULES: usize = 20;

pub(crate) fn render_diff(d: &Value) -> String {
    let mut out = format!(
        "{} vs {}\n",
        d["a"].as_str().unwrap_or("?"),
        d["b"].as_str().unwrap_or("?")
    );
    let s = &d["summary"];
    out.push_str(&format!(
        "modules: {} compared, {} changed; ‖ΔW‖ total {:.4} → {:.4}, ‖ΔW_b − ΔW_a‖ {:.4}\n",
        s["modules_compared"],
        s["modules_changed"],
        s["total_norm_a"].as_f64().unwrap_or(f64::NAN),
        s["total_norm_b"].as_f64().unwrap_or(f64::NAN),
        s["total_diff_norm"].as_f64().unwrap_or(f64::NAN),
    ));
    for side in ["only_in_a", "only_in_b"] {
        if let Some(list) = s[side].as_array().filter(|l| !l.is_empty()) {
            out.push_str(&format!(
                "{side}: {}\n",
                compact(&Value::Array(list.clone()))
            ));
        }
    }
    for (title, key) in [
        ("entry fields", "metadata"),
        ("LoRA settings", "lora_config"),
    ] {
        if let Some(m) = d[key].as_object().filter(|m| !m.is_empty()) {
            out.push_str(&format!("{title} that differ:\n"));
            for (k, v) in m {
                // Maps (files_sha256, training_config) are shown key by key.
                if let (Value::Object(_), Value::Object(_)) = (&v["a"], &v["b"]) {
                    let inner = differing_fields(&v["a"], &v["b"]);
                    for (ik, iv) in inner.as_object().into_iter().flatten() {
                        out.push_str(&format!(
                            "  {k}.{ik}: {} → {}\n",
                            shorten(&compact(&iv["a"])),
                            shorten(&compact(&iv["b"]))
                        ));
                    }
                    continue;
                }
                out.push_str(&format!(
                    "  {k}: {} → {}\n",
                    shorten(&compact(&v["a"])),
                    shorten(&compact(&v["b"]))
                ));
            }
        }
    }
    let mut mods: Vec<&Value> = d["modules"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|m| m["changed"] == Value::Bool(true))
                .collect()
        })
        .unwrap_or_default();
    mods.sort_by(|x, y| {
        let f = |m: &Value| m["diff_norm"].as_f64().unwrap_or(0.0);
        f(y).total_cmp(&f(x))
    });
    if !mods.is_empty() {
        let mut rows = vec![vec![
            "MODULE".to_string(),
            "‖ΔW_a‖".into(),
            "‖ΔW_b‖".into(),
            "‖ΔW_b−ΔW_a‖".into(),
        ]];
        for m in mods.iter().take(DIFF_TOP_MODULES) {
            rows.push(vec![
                m["module"].as_str().unwrap_or("?").to_string(),
                format!("{:.4}", m["norm_a"].as_f64().unwrap_or(f64::NAN)),
                format!("{:.4}", m["norm_b"].as_f64().unwrap_or(f64::NAN)),
                format!("{:.4}", m["diff_norm"].as_f64().unwrap_or(f64::NAN)),
            ]);
        }
        out.push_str("largest changes:\n");
        out.push_str(&render_rows(&rows));
        if mods.len() > DIFF_TOP_MODULES {
            out.push_str(&format!(
                "… {} more changed modules (--json lists all)\n",
                mods.len() - DIFF_TOP_MODULES
            ));
        }
    }
    out
}

fn shorten(s: &str) -> String {
    const MAX: usize = 80;
    if s.chars().count() <= MAX {
        s.to_string()
    } else {
        let head: String = s.chars().take(MAX).collect();
        format!("{head}…")
    }
}

/// `YYYY-MM-DD HH:MM:SSZ` (UTC) of a Unix time in ms.
fn format_time_ms(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil-from-days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn eval_cell_and_time_format() {
        assert_eq!(format_time_ms(0), "1970-01-01 00:00:00Z");
        assert_eq!(format_time_ms(951_782_400_000), "2000-02-29 00:00:00Z");
        assert_eq!(format_time_ms(1_796_034_083_123), "2026-11-30 10:21:23Z");
        let e = json!({"live": {"exact_match": 1.0}, "candidate": {"exact_match": 1.0 / 6.0}});
        assert_eq!(eval_cell(Some(&e)), "100.0%→16.7%");
        assert_eq!(eval_cell(None), "-");
    }
}
