//! Repeated measurements and the figures built from them.

use serde::Serialize;

/// Repeated measurements of one quantity.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Sample {
    pub(crate) values: Vec<f64>,
}

impl Sample {
    pub(crate) fn push(&mut self, v: f64) {
        self.values.push(v);
    }

    pub(crate) fn median(&self) -> f64 {
        percentile(&self.values, 0.5)
    }

    pub(crate) fn min(&self) -> f64 {
        self.values.iter().copied().fold(f64::INFINITY, f64::min)
    }

    pub(crate) fn max(&self) -> f64 {
        self.values
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max)
    }
}

/// The `p`-quantile (0..=1) of `values`, nearest rank.
pub(crate) fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = (p * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// One line of the results: a measured quantity against its baseline from the same run.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Figure {
    pub(crate) id: &'static str,
    pub(crate) what: String,
    pub(crate) unit: &'static str,
    pub(crate) measured: Sample,
    pub(crate) baseline_name: String,
    pub(crate) baseline: Sample,
    /// median(measured) / median(baseline), or the inverse where lower is better.
    pub(crate) ratio: f64,
    pub(crate) target: String,
    pub(crate) met: Option<bool>,
}

impl Figure {
    /// A higher-is-better figure; `min_ratio` is its target, if it has one.
    pub(crate) fn at_least(
        id: &'static str,
        what: impl Into<String>,
        unit: &'static str,
        measured: Sample,
        baseline_name: impl Into<String>,
        baseline: Sample,
        min_ratio: Option<f64>,
    ) -> Self {
        let target = min_ratio.map(|r| (format!("ratio >= {r}"), move |ratio: f64| ratio >= r));
        Self::of_ratio(id, what, unit, measured, baseline_name, baseline, target)
    }

    /// median(measured) / median(baseline), with a target on that ratio, if any.
    fn of_ratio(
        id: &'static str,
        what: impl Into<String>,
        unit: &'static str,
        measured: Sample,
        baseline_name: impl Into<String>,
        baseline: Sample,
        target: Option<(String, impl Fn(f64) -> bool)>,
    ) -> Self {
        let ratio = measured.median() / baseline.median();
        let met = target.as_ref().map(|(_, met)| met(ratio));
        Self {
            id,
            what: what.into(),
            unit,
            measured,
            baseline_name: baseline_name.into(),
            baseline,
            ratio,
            target: target.map_or_else(|| "-".to_owned(), |(text, _)| text),
            met,
        }
    }

    /// A lower-is-better figure (a latency): the ratio is baseline / measured, how many times
    /// better the measured variant is; the target, if any, bounds the measured median.
    pub(crate) fn at_most(
        id: &'static str,
        what: impl Into<String>,
        unit: &'static str,
        measured: Sample,
        baseline_name: impl Into<String>,
        baseline: Sample,
        max_value: Option<f64>,
    ) -> Self {
        Self {
            id,
            what: what.into(),
            unit,
            ratio: baseline.median() / measured.median(),
            target: max_value.map_or_else(|| "-".to_owned(), |v| format!("median <= {v} {unit}")),
            met: max_value.map(|v| measured.median() <= v),
            measured,
            baseline_name: baseline_name.into(),
            baseline,
        }
    }

    /// A cost against the same cost at a smaller scale: the ratio is measured / baseline, how
    /// many times more the measured variant costs; `max_ratio`, if any, is its target.
    pub(crate) fn cost(
        id: &'static str,
        what: impl Into<String>,
        unit: &'static str,
        measured: Sample,
        baseline_name: impl Into<String>,
        baseline: Sample,
        max_ratio: Option<f64>,
    ) -> Self {
        let target = max_ratio.map(|r| (format!("ratio <= {r}"), move |ratio: f64| ratio <= r));
        Self::of_ratio(id, what, unit, measured, baseline_name, baseline, target)
    }

    pub(crate) fn row(&self) -> String {
        let s = |x: &Sample| format!("{:>10.1} [{:.1}..{:.1}]", x.median(), x.min(), x.max());
        let met = match self.met {
            Some(true) => "met",
            Some(false) => "MISSED",
            None => "-",
        };
        format!(
            "{:<4} {:<44} {} {:<8} vs {:<34} {} ratio {:>6.3}  {:<16} {met}",
            self.id,
            self.what,
            s(&self.measured),
            self.unit,
            self.baseline_name,
            s(&self.baseline),
            self.ratio,
            self.target
        )
    }
}
