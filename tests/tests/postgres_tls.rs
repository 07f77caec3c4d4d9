//! The test cluster the scripts run (scripts/postgres.sh) accepts TCP connections only over
//! TLS with a scram-sha-256 password, and the tests reach it with `sslmode=verify-full`
//! against the scripts' authority. These checks hold the suite's own database to that: a
//! connection without TLS is refused, a wrong password is an error naming the failure and
//! neither password, and the same server is not trusted through another authority.
//!
//! They need `OUTBOX_TEST_DATABASE_URL` (or the scripts' default) to be such a URL, and fail,
//! saying so, when it is not: the suite always runs against the scripts' cluster.

use std::path::PathBuf;
use std::str::FromStr;

use anyhow::{Context, Result, ensure};
use outbox_tests::{database_parts, database_url};
use sqlx::postgres::{PgConnectOptions, PgSslMode};
use sqlx::{ConnectOptions, Connection};

/// The test URL's options, its password and its root certificate; fails unless it is the
/// verified TLS connection the scripts' cluster is reached with.
fn tls_target() -> Result<(PgConnectOptions, String, PathBuf)> {
    let parts = database_parts()?;
    ensure!(
        parts.sslmode.as_deref() == Some("verify-full"),
        "OUTBOX_TEST_DATABASE_URL must reach the scripts' PostgreSQL cluster with \
         sslmode=verify-full (scripts/postgres.sh sets it); it has sslmode={:?}",
        parts.sslmode
    );
    ensure!(
        !parts.password.is_empty(),
        "OUTBOX_TEST_DATABASE_URL must carry the cluster's password (scram-sha-256)"
    );
    let ca = PathBuf::from(
        parts
            .sslrootcert
            .context("OUTBOX_TEST_DATABASE_URL must name the scripts' authority (sslrootcert)")?,
    );
    Ok((
        PgConnectOptions::from_str(&database_url())?,
        parts.password,
        ca,
    ))
}

/// Whether this session is encrypted, as the server sees it.
async fn server_sees_tls(options: &PgConnectOptions) -> Result<bool> {
    let mut conn = options.connect().await?;
    let ssl: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(&mut conn)
        .await?;
    conn.close().await?;
    Ok(ssl)
}

/// The failure of a connection that must fail, as text; panics if it succeeded.
async fn refusal(options: &PgConnectOptions) -> String {
    match options.connect().await {
        Ok(_) => panic!("the connection was accepted"),
        Err(e) => format!("{e} / {e:?}"),
    }
}

#[tokio::test]
async fn the_test_url_is_verified_tls_by_name_and_by_address() -> Result<()> {
    let (options, _, _) = tls_target()?;
    assert!(server_sees_tls(&options).await?, "connected without TLS");
    // The certificate names 127.0.0.1 too: verify-full by address works as well.
    let by_address = options.clone().host("127.0.0.1");
    assert!(server_sees_tls(&by_address).await?);
    Ok(())
}

#[tokio::test]
async fn a_connection_without_tls_is_refused() -> Result<()> {
    let (options, password, _) = tls_target()?;
    let error = refusal(&options.ssl_mode(PgSslMode::Disable)).await;
    assert!(
        error.contains("no pg_hba.conf entry") && error.contains("no encryption"),
        "refused for want of TLS, got: {error}"
    );
    assert!(!error.contains(&password), "the error shows the password");
    Ok(())
}

#[tokio::test]
async fn a_wrong_password_names_the_failure_and_neither_password() -> Result<()> {
    let (options, password, _) = tls_target()?;
    let wrong = format!("wrong-{}", uuid::Uuid::new_v4().simple());
    let error = refusal(&options.password(&wrong)).await;
    assert!(
        error.contains("password authentication failed"),
        "names the failure, got: {error}"
    );
    assert!(!error.contains(&password), "the error shows the password");
    assert!(
        !error.contains(&wrong),
        "the error shows the wrong password"
    );
    Ok(())
}

#[tokio::test]
async fn the_server_is_not_trusted_through_another_authority() -> Result<()> {
    let (options, password, ca) = tls_target()?;
    // scripts/tls.sh's second authority, which signed none of the server's certificates.
    let rogue = ca.with_file_name("rogue-ca.pem");
    ensure!(
        rogue.is_file(),
        "{} is missing (scripts/tls.sh makes it beside ca.pem)",
        rogue.display()
    );
    let error = refusal(&options.ssl_root_cert(&rogue)).await;
    assert!(
        error.contains("invalid peer certificate") && error.contains("UnknownIssuer"),
        "a certificate verification failure, got: {error}"
    );
    assert!(!error.contains(&password), "the error shows the password");
    Ok(())
}
