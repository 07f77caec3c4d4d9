use std::time::Duration;

/// Delay before retry number `attempts + 1`: `base` doubled per earlier attempt, capped at
/// `max`, scaled by a random factor in [0.5, 1) so that work that failed together does not
/// retry together.
pub fn backoff(base: Duration, max: Duration, attempts: u32) -> Duration {
    let exp = base.saturating_mul(1_u32.checked_shl(attempts.min(31)).unwrap_or(u32::MAX));
    exp.min(max).mul_f64(rand::random_range(0.5..1.0))
}
