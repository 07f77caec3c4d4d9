//! Whose failure an error is. A database that cannot be reached is nobody's message's fault:
//! the message waits, however long the outage, and is never quarantined for it. An error the
//! database returned for this message's transaction (a constraint checked at COMMIT, a
//! serialization failure, bad data) will most likely come back on every attempt, so it counts
//! against the message like a handler error, and after `max_attempts` the failure policy
//! decides. Retrying it forever instead would stall the partition behind one message.
//!
//! A handler can also end its transaction's chance to commit without saying so: it ignores a
//! failed statement (the transaction is then aborted, and Postgres answers its COMMIT with
//! `ROLLBACK` and no error, which sqlx does not read), or it holds the connection past the
//! server's `idle_in_transaction_session_timeout` (the server ends the session), or it ends
//! the transaction itself (`ROLLBACK`, `COMMIT`, perhaps followed by a `BEGIN` of another).
//! So before its COMMIT, a transaction is checked to be the one that inserted the dedup rows,
//! and still able to commit (`ConsumerSql::holds_dedup_row`, one statement per transaction),
//! and what the check finds is the handler's failure (`handler_aborted_transaction`). A
//! handler's `ROLLBACK` in a batch lets the handlers after it write in autocommit: that is
//! found too, but their writes stay (a handler must never end its transaction). A connection
//! lost under a handler is an outage if the database does not answer on another one, or if
//! the handler did not hold the transaction long enough for the server to end its session
//! (then it was cut from outside: a network reset, a failover).

use std::time::Duration;

use sqlx::{Connection, PgConnection, PgPool};

/// The quarantine reason of a handler that returned `Ok` on a transaction that can no longer
/// commit.
pub(crate) const HANDLER_ABORTED: &str = "handler_aborted_transaction";

/// How long the database is given to answer on another connection before a lost connection
/// is taken for an outage.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why one attempt at a message did not commit.
#[derive(Debug)]
pub(crate) enum AttemptError {
    /// The database could not be reached: retried with backoff, without counting.
    Unavailable(sqlx::Error),
    /// The attempt failed: counted, and the failure policy applies after `max_attempts`.
    Failed {
        /// The quarantine reason if it is the last attempt (`handler_failed`,
        /// `handler_aborted_transaction`, `commit_failed`, `transaction_failed`).
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

    /// What the check before COMMIT (`ConsumerSql::holds_dedup_row`) found after the handler returned
    /// `Ok`: the transaction cannot commit, and that is the handler's failure.
    pub(crate) fn aborted_by_handler(error: &str) -> Self {
        Self::Failed {
            reason: HANDLER_ABORTED,
            error: format!(
                "the handler returned Ok, but its transaction could not commit (a statement of \
                 it failed and the error was not returned, or the connection was held too long): {error}"
            ),
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
            // Its statement found the transaction aborted by an earlier one of its own.
            Ok(error) if has_sqlstate(&error, &["25P02"]) => Self::Failed {
                reason: HANDLER_ABORTED,
                error: describe(&error),
                retry,
            },
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

fn has_sqlstate(error: &sqlx::Error, codes: &[&str]) -> bool {
    match error {
        sqlx::Error::Database(db) => db.code().is_some_and(|code| codes.contains(&&*code)),
        _ => false,
    }
}

/// Whether `error` says the transaction was already unable to commit when the statement
/// came (aborted: 25P02; its session ended while it was idle: 25P03), so that, in a batch,
/// an earlier handler on the same transaction may be the one at fault.
pub(crate) fn is_inherited(error: &sqlx::Error) -> bool {
    has_sqlstate(error, &["25P02", "25P03"])
}

/// Whether `error` is the loss of the connection itself (not an answer of the server).
pub(crate) fn is_connection_lost(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Io(_) | sqlx::Error::Protocol(_))
}

/// Whether the database answers on a connection of its own, made with `pool`'s options, and
/// if so after how long it ends a session idle in a transaction
/// (`idle_in_transaction_session_timeout`, or `transaction_timeout` where it exists, whichever
/// is shorter; zero: never). Not a connection of `pool`: the lost one is still taken from it
/// until its transaction is dropped, so a pool of one connection, or one whose connections
/// are all busy, would make every such question time out, and the message be retried as if in
/// an outage forever.
pub(crate) async fn database_answers(pool: &PgPool) -> Option<Duration> {
    let options = pool.connect_options();
    let probe = async {
        let mut conn = PgConnection::connect_with(&options).await?;
        let answer = sqlx::query_scalar::<_, i64>(SESSION_TIMEOUT)
            .fetch_one(&mut conn)
            .await;
        // Closing says goodbye to the server; an error doing so changes nothing.
        let _ = conn.close().await;
        answer
    };
    match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
        Ok(Ok(ms)) => Some(Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
        _ => None,
    }
}

/// The shortest of the server's timeouts that end a session in a transaction, in
/// milliseconds (0: none is set).
const SESSION_TIMEOUT: &str = "SELECT COALESCE(min(setting::bigint) FILTER (WHERE setting <> '0'), 0) \
     FROM pg_settings WHERE name IN ('idle_in_transaction_session_timeout', 'transaction_timeout')";

/// Whether `error`, met on the connection of a transaction that handlers ran on, means the
/// database is unavailable: a connection lost is only if the database does not answer on
/// another one either. (In a batch the messages are then replayed alone, and the one at
/// fault, if any, is found by [`lost_alone`].)
pub(crate) async fn is_outage(pool: &PgPool, error: &sqlx::Error) -> bool {
    is_unavailable(error) && !(is_connection_lost(error) && database_answers(pool).await.is_some())
}

/// What a connection lost under one message's transaction, `held` since it began, was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lost {
    /// The message's failure: not an outage at all, or the server could have ended the
    /// session for the handler's holding it (it sends its reason, SQLSTATE 25P03, to the next
    /// statement, which the handler may have swallowed, and closes the connection).
    Failure,
    /// The database does not answer on another connection either.
    Outage,
    /// Cut from outside, the database answering on another connection (a network reset, a
    /// failover behind a proxy; or a proxy's or a NAT's idle limit below how long the handler
    /// holds the transaction, which cuts every try: see `CUTS_UNCHARGED`).
    Cut,
}

/// What `error` met on the transaction of one message, `held` since it began, was (see
/// [`Lost`]). A protocol error stays this connection's (and the message's).
pub(crate) async fn lost_alone(pool: &PgPool, error: &sqlx::Error, held: Duration) -> Lost {
    if !is_unavailable(error) {
        return Lost::Failure;
    }
    if !is_connection_lost(error) {
        return Lost::Outage;
    }
    match database_answers(pool).await {
        None => Lost::Outage,
        Some(timeout)
            if matches!(error, sqlx::Error::Io(_)) && (timeout.is_zero() || held < timeout) =>
        {
            Lost::Cut
        }
        Some(_) => Lost::Failure,
    }
}

/// The `sqlx::Error` a handler returned as is, if it did.
pub(crate) fn handler_sql_error(error: &crate::HandlerError) -> Option<&sqlx::Error> {
    match error {
        crate::HandlerError::Retry(error) | crate::HandlerError::Quarantine(error) => {
            error.downcast_ref()
        }
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

pub(crate) fn describe(error: &sqlx::Error) -> String {
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
        // A lost connection is an outage only if the database does not answer elsewhere; a
        // pool that times out is one already.
        let lost = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
        assert!(is_unavailable(&lost) && is_connection_lost(&lost));
        assert!(!is_connection_lost(&sqlx::Error::PoolTimedOut));
        assert!(!is_inherited(&lost));
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
