//! The stuck-key faults: a row of one key whose payload is over the topic's
//! `max.message.bytes` (the broker rejects it for good: it must be quarantined with
//! `MessageSizeTooLarge`), then a backlog of 3 × the largest relay batch of the same key, while
//! the producer goes on with the other keys. Once under each of the relays' quarantine
//! policies, each with a key of its own (a quarantined row under `BlockKey` holds its key for
//! the rest of the run):
//!
//! * **`stuck_key`**, under `SkipQuarantined` (the default): the backlog flows after the
//!   quarantined row. Timed from the failing row's commit, for the other keys (logged) and for
//!   everything (the figure).
//! * **`blocked_key`**, with the relays restarted under `BlockKey`: the backlog must stay
//!   pending behind the quarantined row while every other key flows (timed from the failing
//!   row's commit); then the harness, as the operator, discards the row (what `outbox
//!   quarantine discard relay <seq>` does) and the backlog must flow (timed from the discard).
//!   The checker proves the wait from the database: no later row of the key was published
//!   before the discard (`published_past_block`). The relays then go back to the profile's
//!   policy, so that the faults after this one run as they would without it.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use outbox_producer::Outbox;
use sqlx::AssertSqlSafe;
use uuid::Uuid;

use super::{Figure, LongFaultPhase, TOPIC_MAX_MESSAGE_BYTES, write_batch};
use crate::children::relay::Policy;
use crate::fleet::{MAX_RELAY_BATCH, lock};
use crate::summary::Kind;

/// The key of the `stuck_key` fault (the producer's keys are `k000`, `k001`, ...).
pub(crate) const STUCK_KEY: &str = "kstuck";

/// The key of the `blocked_key` fault.
pub(crate) const BLOCKED_KEY: &str = "kblocked";

/// Checking the checker: with `CHAOS_SABOTAGE=skip-quarantined`, the `blocked_key` fault
/// leaves the relays on `SkipQuarantined`, so the backlog flows past the quarantined row and
/// the run must fail with `published_past_block` > 0.
fn sabotaged() -> bool {
    std::env::var("CHAOS_SABOTAGE").is_ok_and(|v| v == "skip-quarantined")
}

impl LongFaultPhase<'_> {
    pub(super) async fn stuck_key(&mut self) -> Result<Duration> {
        let (big, since) = self.write_stuck_key(STUCK_KEY).await?;
        lock(self.fleet).counts.add(Kind::StuckKey, 1);
        let watermark = self.mark().await?;
        let others = self.time_drain(watermark, Some(STUCK_KEY), since).await?;
        tracing::info!(took = ?others, "stuck key: the other keys flowed");
        let all = self.time_drain(watermark, None, since).await?;
        let status = self.status_of(big).await?;
        tracing::info!(?status, took = ?all, "stuck key: its backlog flowed after the failing row");
        Ok(all)
    }

    /// Returns two figures: the other keys flowed while the key was blocked (from the
    /// failing row's commit), and everything flowed after the operator acted (from the
    /// discard).
    pub(super) async fn blocked_key(&mut self) -> Result<[Figure; 2]> {
        let profile_policy = lock(self.fleet).launch_mut().relay_policy;
        if sabotaged() {
            tracing::warn!("CHAOS_SABOTAGE=skip-quarantined: the relays keep SkipQuarantined");
        } else {
            self.restart_relays(|launch| launch.relay_policy = Policy::BlockKey)
                .await?;
        }
        let (big, since) = self.write_stuck_key(BLOCKED_KEY).await?;
        lock(self.fleet).counts.add(Kind::BlockedKey, 1);
        let watermark = self.mark().await?;
        let others = self.time_drain(watermark, Some(BLOCKED_KEY), since).await?;
        tracing::info!(took = ?others, "blocked key: the other keys flowed");
        // Without the quarantine there is nothing for the operator to discard: the row's
        // expectation then fails in the checker, and the figure is over the bound.
        if !self.await_quarantined(big).await? {
            tracing::error!(id = %big, status = ?self.status_of(big).await?, "blocked key: the failing row was not quarantined");
            return Ok([
                (Kind::BlockedKey, others),
                (Kind::BlockedKey, since.elapsed()),
            ]);
        }
        // The operator acts only once the relays have claimed past the quarantined row: a
        // marker committed after the quarantine is published by such claims, and under
        // `SkipQuarantined` they would have taken the backlog (earlier rows) first. Without
        // this, a discard right after the quarantine could come before any relay looked.
        let watermark = self.mark().await?;
        let past = self
            .time_drain(watermark, Some(BLOCKED_KEY), Instant::now())
            .await?;
        let held = self.unpublished_after(BLOCKED_KEY, big).await?;
        tracing::info!(
            took = ?past,
            held,
            "blocked key: the other keys flowed past its quarantined row; the operator discards it"
        );
        self.discard_as_operator(big, BLOCKED_KEY).await?;
        let discarded = Instant::now();
        let watermark = self.mark().await?;
        let released = self.time_drain(watermark, None, discarded).await?;
        tracing::info!(took = ?released, "blocked key: its backlog flowed after the discard");
        if !sabotaged() {
            self.restart_relays(|launch| launch.relay_policy = profile_policy)
                .await?;
        }
        Ok([(Kind::BlockedKey, others), (Kind::BlockedKey, released)])
    }

    /// Commits the failing row of `key` (expected in quarantine), then its backlog; returns
    /// the row's id and when it committed.
    async fn write_stuck_key(&self, key: &str) -> Result<(Uuid, Instant)> {
        let pool = &self.db.pool;
        let outbox = Outbox::new(self.tables);
        // Over the topic's limit, not the client's (`message.max.bytes`, 1 MB), so that the
        // broker is the one refusing it.
        let big = Uuid::new_v4();
        sqlx::query(
            "INSERT INTO chaos_expected_quarantine (event_id, reason_contains) VALUES ($1, $2)",
        )
        .bind(big)
        .bind("MessageSizeTooLarge")
        .execute(pool)
        .await?;
        write_batch(
            pool,
            &outbox,
            self.topic,
            key,
            &[big],
            "s".repeat(2 * TOPIC_MAX_MESSAGE_BYTES),
        )
        .await?;
        let committed = Instant::now();
        // 3 x the largest batch a relay runs with: a claim that let held-back rows fill its
        // LIMIT would starve the other keys behind them.
        let backlog = 3 * MAX_RELAY_BATCH as usize;
        for chunk in 0..backlog.div_ceil(40) {
            let n = 40.min(backlog - chunk * 40);
            let ids: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
            write_batch(pool, &outbox, self.topic, key, &ids, String::new()).await?;
        }
        tracing::info!(
            key,
            backlog,
            "long fault: a row the broker rejects for good, its key's backlog behind it"
        );
        Ok((big, committed))
    }

    /// Waits (up to the plan's `drain_wait`) until the row `id` is quarantined.
    async fn await_quarantined(&self, id: Uuid) -> Result<bool> {
        let began = Instant::now();
        while began.elapsed() < self.plan.drain_wait {
            if self
                .status_of(id)
                .await?
                .is_some_and(|(status, _)| status == "quarantined")
            {
                return Ok(true);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Ok(false)
    }

    /// Rows of `key` after the row `id` that are not published yet.
    async fn unpublished_after(&self, key: &str, id: Uuid) -> Result<i64> {
        let outbox = &self.tables.outbox;
        Ok(sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {outbox} \
             WHERE aggregateid = $1 AND status <> 'published' \
               AND seq > (SELECT seq FROM {outbox} WHERE id = $2)"
        )))
        .bind(key)
        .bind(id)
        .fetch_one(&self.db.pool)
        .await?)
    }

    /// Discards the quarantined row `id` as an operator would, through the library's
    /// quarantine API (as `outbox quarantine discard relay <seq>` does), and records in the
    /// same transaction what the row looked like and when it went.
    async fn discard_as_operator(&self, id: Uuid, key: &str) -> Result<()> {
        let mut tx = self.db.pool.begin().await?;
        let (seq, last_error): (i64, Option<String>) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT seq, last_error FROM {} WHERE id = $1 FOR UPDATE",
            self.tables.outbox
        )))
        .bind(id)
        .fetch_one(&mut *tx)
        .await?;
        let note = outbox_core::ActionNote::new().reason("chaos: the stuck key's operator");
        let discarded =
            outbox_producer::quarantine::discard(&mut tx, self.tables, &[seq], &note).await?;
        ensure!(
            discarded == 1,
            "discarding row {seq} deleted {discarded} rows"
        );
        sqlx::query(
            "INSERT INTO chaos_operator_discards (event_id, key, seq, last_error) \
             VALUES ($1, $2, $3, $4)",
        )
        .bind(id)
        .bind(key)
        .bind(seq)
        .bind(&last_error)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        tracing::info!(
            seq,
            ?last_error,
            "blocked key: the operator discarded the row"
        );
        Ok(())
    }

    async fn status_of(&self, id: Uuid) -> Result<Option<(String, Option<String>)>> {
        Ok(sqlx::query_as(AssertSqlSafe(format!(
            "SELECT status, last_error FROM {} WHERE id = $1",
            self.tables.outbox
        )))
        .bind(id)
        .fetch_optional(&self.db.pool)
        .await?)
    }
}
