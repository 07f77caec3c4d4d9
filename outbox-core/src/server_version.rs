//! The oldest PostgreSQL the framework runs on, checked before it relies on it.

use sqlx::PgConnection;

use crate::CoreError;

/// The oldest PostgreSQL major version supported: the consumer's check before `COMMIT` uses
/// `pg_current_xact_id_if_assigned()` (13), and versions before 13 are out of support. On 12,
/// that check failed as every handler's failure, and every event was quarantined.
pub const MIN_POSTGRES: i32 = 13;

/// Fails with [`CoreError::UnsupportedServer`] when `conn`'s server is older than
/// [`MIN_POSTGRES`] ([`CoreError::Database`] when it cannot be asked).
pub async fn check_server_version(conn: &mut PgConnection) -> Result<(), CoreError> {
    let (number, text): (i32, String) = sqlx::query_as(
        "SELECT current_setting('server_version_num')::int, current_setting('server_version')",
    )
    .fetch_one(&mut *conn)
    .await?;
    supported(number, &text)
}

fn supported(number: i32, text: &str) -> Result<(), CoreError> {
    if number / 10_000 >= MIN_POSTGRES {
        Ok(())
    } else {
        Err(CoreError::UnsupportedServer(format!(
            "PostgreSQL {} is older than {MIN_POSTGRES}, the oldest this framework supports: \
             upgrade the server",
            crate::escape(text)
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_before_13_are_refused_with_what_to_do() {
        let refused = supported(120_022, "12.22").expect_err("12 is refused");
        assert!(
            refused
                .to_string()
                .contains("PostgreSQL 12.22 is older than 13")
        );
        assert!(refused.to_string().contains("upgrade"));
        assert!(supported(130_000, "13.0").is_ok());
        assert!(supported(150_018, "15.18 (Debian)").is_ok());
        assert!(supported(180_001, "18.1").is_ok());
    }
}
