//! CPU time spent by PostgreSQL's processes and by this one, from `/proc`: on a machine whose
//! cores every party shares, a throughput figure is set by the CPU each action costs, so a
//! breakdown says whose CPU it is (the database's, or this process's: the library, the
//! client and, in P9, the API it serves).

use std::time::Duration;

/// CPU time (user and system) used so far.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CpuTimes {
    /// The PostgreSQL server's processes: its postmaster and every child (backends, WAL
    /// writer, checkpointer, autovacuum workers), those that ended included.
    pub(crate) postgres: Duration,
    /// This process.
    pub(crate) this: Duration,
}

impl CpuTimes {
    /// Now, for the server whose postmaster is `postmaster` ([`postmaster`]). Zero where
    /// `/proc` cannot be read (not Linux, or a server on another machine).
    pub(crate) fn now(postmaster: Option<u32>) -> Self {
        let mut times = Self {
            this: process_cpu("self").unwrap_or_default(),
            ..Self::default()
        };
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return times;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name
                .to_str()
                .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
            else {
                continue;
            };
            let Some(postmaster) = postmaster else {
                break;
            };
            if pid == postmaster.to_string() {
                // With the time of its children that ended (a closed connection's backend,
                // an autovacuum worker): reaped, their time moves here.
                times.postgres +=
                    process_cpu(pid).unwrap_or_default() + ticks(pid, 13, 14).unwrap_or_default();
            } else if stat_field(pid, 1).is_some_and(|ppid| ppid == u64::from(postmaster)) {
                times.postgres += process_cpu(pid).unwrap_or_default();
            }
        }
        times
    }

    /// What was used since `earlier`.
    pub(crate) fn since(self, earlier: Self) -> Self {
        Self {
            postgres: self.postgres.saturating_sub(earlier.postgres),
            this: self.this.saturating_sub(earlier.this),
        }
    }
}

/// The postmaster of the server `pool` connects to: the parent of one of its backends, when
/// that backend runs on this machine.
pub(crate) async fn postmaster(pool: &sqlx::PgPool) -> Option<u32> {
    let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(pool)
        .await
        .ok()?;
    let ppid = stat_field(&backend.to_string(), 1)?;
    // A server elsewhere (another machine, a container) reports a pid that means something
    // else here, or nothing.
    let is_postgres = |pid: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .is_ok_and(|comm| comm.trim_end() == "postgres")
    };
    (is_postgres(&backend.to_string()) && is_postgres(&ppid.to_string()))
        .then(|| u32::try_from(ppid).ok())
        .flatten()
}

/// utime + stime of `/proc/<pid>/stat` (cutime + cstime are the two after), in clock ticks
/// of 1/100 s (`USER_HZ`, 100 on every Linux this runs on).
fn process_cpu(pid: &str) -> Option<Duration> {
    ticks(pid, 11, 12)
}

/// The sum of two fields of `/proc/<pid>/stat` in clock ticks, as a duration.
fn ticks(pid: &str, a: usize, b: usize) -> Option<Duration> {
    let ticks = stat_field(pid, a)? + stat_field(pid, b)?;
    Some(Duration::from_millis(ticks * 10))
}

/// Field `n` after the command name of `/proc/<pid>/stat` (0 is the state, 1 the parent).
fn stat_field(pid: &str, n: usize) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count from after it.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    rest.split_whitespace().nth(n)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_cpu_grows_with_work() {
        let before = CpuTimes::now(None);
        let mut x = 0_u64;
        let started = std::time::Instant::now();
        while started.elapsed() < Duration::from_millis(100) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let used = CpuTimes::now(None).since(before);
        assert!(used.this >= Duration::from_millis(50), "{used:?}");
    }
}
