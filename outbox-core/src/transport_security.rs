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
    // sqlx connects to `hostaddr` (the URL's, or PGHOSTADDR) when set, whatever the host says.
    let loopback = match hostaddr(options) {
        Some(address) => address.to_canonical().is_loopback(),
        None => is_loopback(host),
    };
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
    check_kafka_tls_with(config, false)
}

/// [`check_kafka_tls`], for a client whose context supplies OAUTHBEARER tokens
/// (`ClientContext::ENABLE_REFRESH_OAUTH_TOKEN`): `token_from_context` counts as credentials.
pub fn check_kafka_tls_with(
    config: &ClientConfig,
    token_from_context: bool,
) -> Result<(), CoreError> {
    let get = |key: &str| config.get(key).map(str::to_ascii_lowercase);
    let protocol = get("security.protocol").unwrap_or_else(|| "plaintext".to_owned());
    let mechanism = get("sasl.mechanisms")
        .or_else(|| get("sasl.mechanism"))
        .unwrap_or_else(|| "gssapi".to_owned());
    // Kerberos sends no reusable secret; every other mechanism does (a password, a SCRAM
    // exchange an attacker in the middle completes, a bearer token).
    let secret_keys = [
        "sasl.password",
        "sasl.oauthbearer.client.secret",
        "sasl.oauthbearer.config",
        "sasl.oauthbearer.assertion.private.key.file",
        "sasl.oauthbearer.assertion.private.key.pem",
    ];
    let credentials = token_from_context
        || secret_keys
            .iter()
            .any(|key| config.get(key).is_some_and(|v| !v.is_empty()))
        || (protocol.starts_with("sasl") && mechanism != "gssapi");
    if !credentials {
        return Ok(());
    }
    let truthy = |v: String| matches!(v.as_str(), "true" | "t" | "1");
    let verified = get("enable.ssl.certificate.verification").is_none_or(truthy);
    let host_checked = get("ssl.endpoint.identification.algorithm").is_none_or(|v| v == "https");
    let why = if protocol != "sasl_ssl" {
        // Named only when it is a protocol: a value put in the wrong key may be a secret.
        let shown = if ["plaintext", "ssl", "sasl_plaintext"].contains(&protocol.as_str()) {
            format!("security.protocol={protocol} sends them without TLS")
        } else {
            "security.protocol is not SASL_SSL".to_owned()
        };
        format!("{shown}; set security.protocol=SASL_SSL")
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
        || bare
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.to_canonical().is_loopback())
}

/// The address sqlx connects to instead of resolving the host, if any. sqlx has no getter for
/// it: it is read back from the options' URL form (never shown: it carries the password).
fn hostaddr(options: &PgConnectOptions) -> Option<IpAddr> {
    use sqlx::ConnectOptions;
    options
        .to_url_lossy()
        .query_pairs()
        .find(|(key, _)| key == "hostaddr")
        .and_then(|(_, value)| value.parse().ok())
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
            "postgres://u@db.example/app?sslmode=disable&hostaddr=127.0.0.1",
            "postgres://u@[::ffff:127.0.0.1]/app?sslmode=disable",
        ] {
            assert!(database(ok).is_ok(), "{ok}");
        }
        for (refused, says) in [
            ("postgres://u@db.example/app?sslmode=prefer", "prefer"),
            ("postgres://u@db.example/app?sslmode=require", "not checked"),
            ("postgres://u@db.example/app?sslmode=verify-ca", "host name"),
            ("postgres://u@db.example/app?sslmode=disable", "clear text"),
            (
                "postgres://u@localhost/app?sslmode=disable&hostaddr=10.0.0.7",
                "clear text",
            ),
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
        assert!(
            config(&[
                ("security.protocol", "SASL_PLAINTEXT"),
                ("sasl.mechanisms", "GSSAPI")
            ])
            .is_ok()
        );
        assert!(
            config(&[
                ("sasl.mechanisms", "OAUTHBEARER"),
                ("security.protocol", "sasl_plaintext")
            ])
            .is_err()
        );
        assert!(
            config(&[
                ("sasl.password", "pw"),
                ("security.protocol", "SASL_SSL"),
                ("enable.ssl.certificate.verification", "1"),
            ])
            .is_ok()
        );
        let secret_in_protocol =
            config(&[("sasl.password", "pw"), ("security.protocol", "hunter2")])
                .expect_err("refused")
                .to_string();
        assert!(
            !secret_in_protocol.contains("hunter2"),
            "{secret_in_protocol}"
        );
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
