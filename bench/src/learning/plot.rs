//! The curves as a PNG: held-out exact match and field accuracy against feedback events.

use std::path::Path;

use super::{ConstantBaseline, CurvePoint, LearningReport};

/// Draws the curves into a PNG with two panels side by side: eval exact match (the issue's
/// figure) and per-field accuracy (which moves long before whole decisions do), both against
/// feedback events. Text needs a TrueType font: DejaVu Sans from the system is used when
/// present, otherwise the plot is drawn without text (the JSON next to it carries the numbers).
pub fn plot(reports: &[LearningReport], path: &Path, title: &str) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let font = [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
    ]
    .iter()
    .find_map(|p| std::fs::read(p).ok());
    let with_text = match font {
        Some(bytes) => {
            let leaked: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, leaked).is_ok()
        }
        None => false,
    };
    // One constant-answer line per world (seed and eval size), not per curve.
    let mut baselines: Vec<(u64, &ConstantBaseline)> = Vec::new();
    for r in reports {
        if let Some(b) = &r.constant_baseline {
            if !baselines
                .iter()
                .any(|(seed, _)| *seed == r.config.scenario.seed)
            {
                baselines.push((r.config.scenario.seed, b));
            }
        }
    }
    // The legend goes under both panels, not inside them: the labels name every setting
    // that differs from the defaults and are far wider than a panel.
    let curve_style = |i: usize| Palette99::pick(i).to_rgba().stroke_width(2);
    let baseline_style =
        |i: usize| ShapeStyle::from(BLACK.mix(0.35 + 0.3 * i as f64)).stroke_width(2);
    let legend: Vec<(Vec<String>, ShapeStyle)> = reports
        .iter()
        .enumerate()
        .map(|(i, r)| (wrap_label(&r.config.label(), LEGEND_CHARS), curve_style(i)))
        .chain(baselines.iter().enumerate().map(|(i, (seed, _))| {
            (
                vec![format!("constant answer (seed {seed})")],
                baseline_style(i),
            )
        }))
        .collect();
    let legend_lines: usize = legend.iter().map(|(lines, _)| lines.len()).sum();
    let legend_px = if with_text {
        30 + LEGEND_LINE_PX * legend_lines as u32
    } else {
        0
    };
    let root = BitMapBackend::new(path, (1400, 600 + legend_px)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = if with_text {
        root.titled(title, ("sans-serif", 22))?
    } else {
        root
    };
    let (panels_area, legend_area) = root.split_vertically(root.dim_in_pixel().1 - legend_px);
    let (left, right) = panels_area.split_horizontally(700);
    // Older result files have no field accuracy; their points are left out of that panel.
    type Metric = fn(&CurvePoint) -> Option<f64>;
    type Baseline = fn(&ConstantBaseline) -> f64;
    let panels: [(&_, &str, Metric, Baseline); 2] = [
        (
            &left,
            "eval exact match",
            |p| Some(p.exact_match),
            |b| b.exact_match,
        ),
        (
            &right,
            "eval field accuracy",
            |p| p.field_accuracy,
            |b| b.field_accuracy,
        ),
    ];
    let max_events = reports
        .iter()
        .flat_map(|r| r.points.iter().map(|p| p.events))
        .max()
        .unwrap_or(1)
        .max(1);
    for (area, y_desc, metric, baseline) in panels {
        let max_y = reports
            .iter()
            .flat_map(|r| r.points.iter().filter_map(metric))
            .chain(baselines.iter().map(|(_, b)| baseline(b)))
            .fold(0.1f64, f64::max)
            .min(1.0)
            * 1.15;
        let mut builder = ChartBuilder::on(area);
        builder.margin(20);
        if with_text {
            builder.x_label_area_size(45).y_label_area_size(60);
        }
        let mut chart = builder.build_cartesian_2d(0u64..max_events, 0f64..max_y)?;
        if with_text {
            chart
                .configure_mesh()
                .x_desc("feedback events")
                .y_desc(y_desc)
                .draw()?;
        } else {
            chart
                .configure_mesh()
                .disable_x_mesh()
                .disable_y_mesh()
                .draw()?;
        }
        for (i, r) in reports.iter().enumerate() {
            let style = curve_style(i);
            let pts: Vec<(u64, f64)> = r
                .points
                .iter()
                .filter_map(|p| metric(p).map(|y| (p.events, y)))
                .collect();
            chart.draw_series(LineSeries::new(pts.clone(), style))?;
            chart.draw_series(pts.iter().map(|p| Circle::new(*p, 4, style.filled())))?;
        }
        for (i, (_, b)) in baselines.iter().enumerate() {
            let y = baseline(b);
            chart.draw_series(DashedLineSeries::new(
                [(0, y), (max_events, y)],
                10,
                6,
                baseline_style(i),
            ))?;
        }
    }
    if with_text {
        let mut y = 10i32;
        for (lines, style) in &legend {
            let mid = y + LEGEND_LINE_PX as i32 / 2 - 2;
            legend_area.draw(&PathElement::new(vec![(30, mid), (60, mid)], *style))?;
            for line in lines {
                legend_area.draw(&Text::new(line.clone(), (70, y), ("sans-serif", 14)))?;
                y += LEGEND_LINE_PX as i32;
            }
        }
    }
    root.present()?;
    Ok(())
}

/// Characters of a legend line before it wraps (at 14 px over the plot's width).
const LEGEND_CHARS: usize = 170;
/// Height of a legend line, pixels.
const LEGEND_LINE_PX: u32 = 18;

/// `label` in lines of at most `width` characters, broken after the commas between its
/// settings (a single setting longer than `width` gets a line of its own).
pub(super) fn wrap_label(label: &str, width: usize) -> Vec<String> {
    let mut lines = vec![String::new()];
    for part in label.split_inclusive(", ") {
        let last = lines.last_mut().map(|l| l.chars().count()).unwrap_or(0);
        if last > 0 && last + part.chars().count() > width {
            lines.push(String::new());
        }
        if let Some(l) = lines.last_mut() {
            l.push_str(if l.is_empty() {
                part.trim_start()
            } else {
                part
            });
        }
    }
    lines.iter().map(|l| l.trim_end().to_string()).collect()
}
