//! Connection settings that hand a password to whoever answers on the network.
//!
//! PostgreSQL: with no `sslmode`, sqlx (as libpq) uses `prefer`: a network attacker answers
//! "no TLS" to the client's request and asks for the password in clear text, which is sent.
//! `require` encrypts but checks no certificate (the attacker terminates TLS); `verify-ca`
//! checks the chain only, and sqlx adds the system roots, so any public certificate passes.
//! Only `verify-full` (chain and host name) keeps the password from an attacker; a Unix
//! socket, or `disable` to a server on this machine, never leaves it.
//!
//! Kafka: SASL credentials over a listener without TLS (`SASL_PLAINTEXT`), or over TLS whose
//! certificate or host name is not checked, are readable or replayable the same way.

use std::net::IpAddr;

use rdkafka::ClientConfig;
use sqlx::postgres::{PgConnectOptions, PgSslMode};

use crate::CoreError;

/// Checks that `options` cannot send the password to a server whose identity was not
/// verified: a Unix socket, `sslmode=verify-full`, or `sslmode=disable` to a loopback host
/// (`localhost`, `127.0.0.0/8`, `::1`). Anything else is [`CoreError::InsecureTransport`],
/// saying what to set.
///
/// ```
/// use sqlx::postgres::PgConnectOptions;
/// let checked = |url: &str| outbox_core::check_database_tls(&url.parse::<PgConnectOptions>().unwrap());
/// assert!(checked("postgres://relay@db.internal/app?sslmode=verify-full").is_ok());
/// assert!(checked("postgres://relay@127.0.0.1/app?sslmode=disable").is_ok());
/// assert!(checked("postgres://relay@db.internal/app?sslmode=require").is_err());
/// assert!(checked("postgres://relay@127.0.0.1/app?sslmode=prefer").is_err());
/// ```
pub fn check_database_tls(options: &PgConnectOptions) -> Result<(), CoreError> {
    let host = options.get_host();
    if options.get_socket().is_some() || host.starts_with('/') {
        return Ok(());
    }
    let mode = options.get_ssl_mode();
    let loopback = is_loopback(host);
    let (sslmode, why) = match mode {
        PgSslMode::VerifyFull => return Ok(()),
        PgSslMode::Disable if loopback => return Ok(()),
        PgSslMode::Disable => (
            "disable",
            "the password and every row cross the network in clear text",
        ),
        PgSslMode::Allow | PgSslMode::Prefer => (
            if matches!(mode, PgSslMode::Allow) {
                "allow"
            } else {
                "prefer (the default)"
            },
            "whoever answers can refuse TLS and ask for the password in clear text",
        ),
        PgSslMode::Require => ("require", "the server's certificate is not checked"),
        PgSslMode::VerifyCa => (
            "verify-ca",
            "the host name is not checked, and the system's roots are trusted: any public certificate passes",
        ),
    };
    let fix = if loopback {
        "set sslmode=verify-full (with sslrootcert=<your CA's certificate>), or sslmode=disable for a server on this machine"
    } else {
        "set sslmode=verify-full (with sslrootcert=<your CA's certificate>)"
    };
    Err(CoreError::InsecureTransport(format!(
        "the database connection to {} uses sslmode={sslmode}: {why}; {fix}",
        crate::escape(host)
    )))
}

/// Checks that a Kafka client configuration sends SASL credentials over verified TLS only:
/// `security.protocol=SASL_SSL` with certificate verification on (librdkafka's default) and
/// the host name checked (`ssl.endpoint.identification.algorithm=https`, its default). A
/// configuration without SASL credentials passes (what it reaches is the broker's to decide).
pub fn check_kafka_tls(config: &ClientConfig) -> Result<(), CoreError> {
    let credentials = [
        "sasl.password",
        "sasl.oauthbearer.client.secret",
        "sasl.oauthbearer.config",
    ]
    .iter()
    .any(|key| config.get(key).is_some_and(|v| !v.is_empty()));
    if !credentials {
        return Ok(());
    }
    let protocol = config
        .get("security.protocol")
        .unwrap_or("plaintext")
        .to_ascii_lowercase();
    let verified = config
        .get("enable.ssl.certificate.verification")
        .is_none_or(|v| v.eq_ignore_ascii_case("true"));
    let host_checked = config
        .get("ssl.endpoint.identification.algorithm")
        .is_none_or(|v| v.eq_ignore_ascii_case("https"));
    let why = if protocol != "sasl_ssl" {
        format!(
            "security.protocol={protocol} sends them without TLS; set security.protocol=SASL_SSL"
        )
    } else if !verified {
        "enable.ssl.certificate.verification=false accepts any certificate; remove it".to_owned()
    } else if !host_checked {
        "ssl.endpoint.identification.algorithm=none accepts a certificate of another host; remove it"
            .to_owned()
    } else {
        return Ok(());
    };
    Err(CoreError::InsecureTransport(format!(
        "the Kafka configuration has SASL credentials, but {why}"
    )))
}

fn is_loopback(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    bare.eq_ignore_ascii_case("localhost")
        || bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn database(url: &str) -> Result<(), CoreError> {
        check_database_tls(&url.parse::<PgConnectOptions>().expect("a valid URL"))
    }

    #[test]
    fn only_verified_tls_a_socket_or_loopback_without_tls_pass() {
        for ok in [
            "postgres://u@db.example/app?sslmode=verify-full",
            "postgres://u@localhost/app?sslmode=disable",
            "postgres://u@127.0.0.2:5433/app?sslmode=disable",
            "postgres://u@[::1]/app?sslmode=disable",
            "postgres://u@%2Fvar%2Frun%2Fpostgresql/app",
        ] {
            assert!(database(ok).is_ok(), "{ok}");
        }
        for (refused, says) in [
            ("postgres://u@db.example/app?sslmode=prefer", "prefer"),
            ("postgres://u@db.example/app?sslmode=require", "not checked"),
            ("postgres://u@db.example/app?sslmode=verify-ca", "host name"),
            ("postgres://u@db.example/app?sslmode=disable", "clear text"),
            (
                "postgres://u@127.0.0.1/app?sslmode=allow",
                "sslmode=disable for a server on this machine",
            ),
        ] {
            let error = database(refused).expect_err(refused).to_string();
            assert!(
                error.contains(says) && error.contains("verify-full"),
                "{refused}: {error}"
            );
        }
    }

    #[test]
    fn sasl_credentials_need_verified_tls() {
        let config = |pairs: &[(&str, &str)]| {
            let mut config = ClientConfig::new();
            for (k, v) in pairs {
                config.set(*k, *v);
            }
            check_kafka_tls(&config)
        };
        assert!(config(&[("security.protocol", "plaintext")]).is_ok());
        assert!(config(&[("sasl.password", "pw"), ("security.protocol", "SASL_SSL")]).is_ok());
        for refused in [
            vec![("sasl.password", "pw")],
            vec![
                ("sasl.password", "pw"),
                ("security.protocol", "SASL_PLAINTEXT"),
            ],
            vec![
                ("sasl.password", "pw"),
                ("security.protocol", "sasl_ssl"),
                ("enable.ssl.certificate.verification", "false"),
            ],
            vec![
                ("sasl.password", "pw"),
                ("security.protocol", "SASL_SSL"),
                ("ssl.endpoint.identification.algorithm", "none"),
            ],
        ] {
            assert!(config(&refused).is_err(), "{refused:?}");
        }
    }
}
