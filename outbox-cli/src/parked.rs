//! `outbox parked ...`: the keys a `ParkKey` consumer parked, their records, and the two ways
//! to let a key flow again (the consumer owning its partition replays its records, in order).

use anyhow::{Context, Result, bail};
use clap::Subcommand;
use outbox_core::{ActionNote, TableNames, escape};
use sqlx::PgConnection;

use crate::print;

#[derive(Debug, Subcommand)]
pub(crate) enum Action {
    /// List the parked keys, oldest first: consumer, topic/partition, key, records parked,
    /// the head's id, offset and reason, and whether a release is pending; then the outbox's
    /// keys whose pending rows wait behind a quarantined row (the relay's and dispatcher's
    /// `BlockKey`), with the row to requeue or discard.
    List {
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Show the records parked under KEY, in offset order, as JSON.
    Show {
        #[command(flatten)]
        key: Key,
    },
    /// Have the consumer replay KEY's parked records through its handler, in offset order,
    /// each once; then the key flows again. A record that fails again parks the key again.
    Release {
        #[command(flatten)]
        key: Key,
        /// Only the key parked by this consumer (every consumer's by default).
        #[arg(long)]
        consumer: Option<String>,
    },
    /// Drop parked record ID for good (audited in `outbox_quarantine_audit` as a discard)
    /// and release its key: the records behind it are replayed.
    Skip {
        id: i64,
        /// Why, recorded with the action.
        #[arg(long)]
        reason: Option<String>,
    },
}

/// A Kafka key, as text or as hex for one that is not UTF-8.
#[derive(Debug, clap::Args)]
#[group(required = true, multiple = false)]
pub(crate) struct Key {
    /// The key, as UTF-8 text.
    key: Option<String>,
    /// The key's bytes in hex.
    #[arg(long)]
    key_hex: Option<String>,
}

impl Key {
    fn bytes(&self) -> Result<Vec<u8>> {
        match (&self.key, &self.key_hex) {
            (Some(text), _) => Ok(text.clone().into_bytes()),
            (None, Some(hex)) => {
                if hex.len() % 2 != 0 || !hex.is_ascii() {
                    bail!("--key-hex takes an even number of hex digits");
                }
                (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).context("--key-hex is not hex"))
                    .collect()
            }
            (None, None) => bail!("give the key, or --key-hex"),
        }
    }
}

/// A key for people, as `release` and `show` take it back: its text when that is printable as
/// it is, else `hex:<bytes>` (give it as `--key-hex <bytes>`).
fn shown(key: &[u8]) -> String {
    match std::str::from_utf8(key) {
        Ok(text) if escape(text).to_string() == text => text.to_owned(),
        _ => format!(
            "hex:{}",
            key.iter().map(|b| format!("{b:02x}")).collect::<String>()
        ),
    }
}

pub(crate) async fn run(
    conn: &mut PgConnection,
    tables: &TableNames,
    action: Action,
) -> Result<()> {
    match action {
        Action::List { limit, json } => {
            let keys = outbox_consumer::parked::list_parked(conn, tables, i64::from(limit)).await?;
            let held =
                outbox_producer::quarantine::held_keys(conn, tables, i64::from(limit)).await?;
            if json {
                let both = serde_json::json!({ "consumer": keys, "outbox": held });
                println!("{}", print::json(&both, false)?);
                return Ok(());
            }
            for k in &keys {
                let release = k
                    .release_requested_at
                    .map_or_else(String::new, |at| format!("\trelease requested {at}"));
                println!(
                    "{}\t{}/{}\tkey={}\trecords={}\thead={} (offset {}, {}: {}){release}",
                    escape(&k.consumer),
                    escape(&k.topic),
                    k.partition,
                    shown(&k.message_key),
                    k.records,
                    k.head_id
                        .map_or_else(|| "-".to_owned(), |id| id.to_string()),
                    k.head_offset
                        .map_or_else(|| "-".to_owned(), |o| o.to_string()),
                    escape(k.head_reason.as_deref().unwrap_or("")),
                    escape(k.head_error.as_deref().unwrap_or("")),
                );
            }
            for h in &held {
                println!(
                    "outbox\t{}\tkey={}\tpending behind={}\tquarantined seq {}: {}\t(requeue or discard it: outbox quarantine requeue|discard relay {})",
                    escape(&h.topic),
                    escape(&h.aggregateid),
                    h.pending_behind,
                    h.quarantined_seq,
                    escape(h.last_error.as_deref().unwrap_or("")),
                    h.quarantined_seq,
                );
            }
            if keys.is_empty() && held.is_empty() {
                println!("no key is parked");
            }
        }
        Action::Show { key } => {
            let records =
                outbox_consumer::parked::parked_records(conn, tables, &key.bytes()?).await?;
            println!("{}", print::json(&records, true)?);
        }
        Action::Release { key, consumer } => {
            let key = key.bytes()?;
            let n =
                outbox_consumer::parked::release(conn, tables, &key, consumer.as_deref()).await?;
            if n == 0 {
                bail!("key {} is not parked", shown(&key));
            }
            println!(
                "release of key {} asked for on {n} partitions: its consumer replays its records",
                shown(&key)
            );
        }
        Action::Skip { id, reason } => {
            let note = reason.map_or_else(ActionNote::new, |r| ActionNote::new().reason(r));
            let n = outbox_consumer::parked::skip(conn, tables, id, &note).await?;
            if n == 0 {
                bail!("no parked record {id}");
            }
            println!("dropped parked record {id}; its key is released");
        }
    }
    Ok(())
}
