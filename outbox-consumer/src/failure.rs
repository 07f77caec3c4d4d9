//! Whose failure an error is. A database that cannot be reached is nobody's message's fault:
//! the message waits, however long the outage, and is never quarantined for it. An error the
//! database returned for this message's transaction (a constraint checked at COMMIT, a
//! serialization failure, bad data) will most likely come back on every attempt, so it counts
//! against the message like a handler error, and after `max_attempts` the failure policy
//! decides. Retrying it forever instead would stall the partition behind one message.

/// Why one attempt at a message did not commit.
#[derive(Debug)]
pub(crate) enum AttemptError {
    /// The database could not be reached: retried with backoff, without counting.
    Unavailable(sqlx::Error),
    /// The attempt failed: counted, and the failure policy applies after `max_attempts`.
    Failed {
        /// The quarantine reason if it is the last attempt (`handler_failed`,
        /// `commit_failed`, `transaction_failed`).
        reason: &'static str,
        /// The error in words.
        error: String,
        /// Whether another attempt could succeed (`false`: quarantine now).
        retry: bool,
    },
}

impl AttemptError {
    /// `error` from one of the consumer's own statements (`BEGIN`, the dedup insert,
    /// `COMMIT`): `reason` names the step if it counts against the message.
    pub(crate) fn from_statement(reason: &'static str, error: sqlx::Error) -> Self {
        if is_unavailable(&error) {
            return Self::Unavailable(error);
        }
        Self::Failed {
            reason,
            error: describe(&error),
            retry: true,
        }
    }

    /// An error the handler returned. A handler whose own query found the database gone
    /// (it returned the `sqlx::Error` as is) is not a failing handler; one that said
    /// [`HandlerError::Quarantine`](crate::HandlerError::Quarantine) is not retried.
    pub(crate) fn from_handler(error: crate::HandlerError) -> Self {
        let (retry, error) = error.into_parts();
        let reason = if retry {
            "handler_failed"
        } else {
            "handler_rejected"
        };
        match error.downcast::<sqlx::Error>() {
            Ok(error) if is_unavailable(&error) => Self::Unavailable(*error),
            Ok(error) => Self::Failed {
                reason,
                error: describe(&error),
                retry,
            },
            Err(error) => Self::Failed {
                reason,
                error: error.to_string(),
                retry,
            },
        }
    }
}

/// Whether `error` means the database cannot be reached (or will not serve anyone right
/// now), as opposed to an answer about this transaction.
pub(crate) fn is_unavailable(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(db) => db.code().is_some_and(|code| unavailable_sqlstate(&code)),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::BeginFailed => true,
        // Decoding, encoding and configuration errors are this code's, not the server's
        // state; an unknown kind is treated as an outage, so it is never counted wrongly.
        sqlx::Error::Configuration(_)
        | sqlx::Error::InvalidArgument(_)
        | sqlx::Error::RowNotFound
        | sqlx::Error::TypeNotFound { .. }
        | sqlx::Error::ColumnIndexOutOfBounds { .. }
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Encode(_)
        | sqlx::Error::Decode(_)
        | sqlx::Error::InvalidSavePointStatement => false,
        _ => true,
    }
}

/// SQLSTATEs of a server that is gone, going, or refusing everyone: connection exceptions
/// (08), insufficient resources (53: too many connections, disk full), system errors (58),
/// shutdowns and a server not yet accepting connections (57P01-57P03; 57014, a cancelled
/// statement, is this transaction's), and a read-only server after a failover (25006).
fn unavailable_sqlstate(code: &str) -> bool {
    matches!(code.get(..2), Some("08" | "53" | "58"))
        || matches!(code, "57P01" | "57P02" | "57P03" | "25006")
}

fn describe(error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => format!("{} (SQLSTATE {code})", db.message()),
            None => db.message().to_owned(),
        },
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outages_are_told_from_answers_about_the_transaction() {
        for code in [
            "08006", "08003", "53300", "57P01", "57P03", "58030", "25006",
        ] {
            assert!(unavailable_sqlstate(code), "{code}");
        }
        for code in [
            "23505", "23503", "40001", "40P01", "22P02", "57014", "42P01",
        ] {
            assert!(!unavailable_sqlstate(code), "{code}");
        }
        assert!(is_unavailable(&sqlx::Error::PoolTimedOut));
        assert!(!is_unavailable(&sqlx::Error::RowNotFound));
        let handler = AttemptError::from_handler(sqlx::Error::PoolClosed.into());
        assert!(matches!(handler, AttemptError::Unavailable(_)));
        // Even a handler that says "quarantine": an outage is nobody's message's fault.
        let handler =
            AttemptError::from_handler(crate::HandlerError::quarantine(sqlx::Error::PoolClosed));
        assert!(matches!(handler, AttemptError::Unavailable(_)));
        let handler = AttemptError::from_handler(crate::HandlerError::retry("no"));
        assert!(matches!(
            handler,
            AttemptError::Failed {
                reason: "handler_failed",
                retry: true,
                ..
            }
        ));
        let handler = AttemptError::from_handler(crate::HandlerError::quarantine("never"));
        assert!(matches!(
            handler,
            AttemptError::Failed {
                reason: "handler_rejected",
                retry: false,
                ..
            }
        ));
    }
}
