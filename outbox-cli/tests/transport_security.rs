//! A network attacker who answers in the database's place: it refuses TLS and asks for the
//! password in clear text, as PostgreSQL's protocol allows. With its default settings the CLI
//! never sends it; `--insecure-transport` does (the server here would catch it).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use anyhow::Result;

/// A listener on a free loopback port that answers as the attacker would, and reports every
/// password a client sends it.
struct FakeServer {
    port: u16,
    passwords: mpsc::Receiver<String>,
}

impl FakeServer {
    fn start() -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let (tx, passwords) = mpsc::channel();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let tx = tx.clone();
                std::thread::spawn(move || {
                    if let Ok(Some(password)) = answer(stream) {
                        let _ = tx.send(password);
                    }
                });
            }
        });
        Ok(Self { port, passwords })
    }
}

/// One client: "no TLS" to its SSLRequest, then a request for its password in clear text.
fn answer(mut stream: TcpStream) -> std::io::Result<Option<String>> {
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut message = read_startup(&mut stream)?;
    // SSLRequest: length 8, code 80877103.
    if message.len() == 4 && message == 80_877_103_u32.to_be_bytes() {
        stream.write_all(b"N")?;
        message = read_startup(&mut stream)?;
    }
    let _ = message;
    // AuthenticationCleartextPassword.
    stream.write_all(&[b'R', 0, 0, 0, 8, 0, 0, 0, 3])?;
    let mut tag = [0; 1];
    stream.read_exact(&mut tag)?;
    let mut len = [0; 4];
    stream.read_exact(&mut len)?;
    let mut body = vec![0; (u32::from_be_bytes(len) as usize).saturating_sub(4)];
    stream.read_exact(&mut body)?;
    Ok((tag[0] == b'p').then(|| {
        String::from_utf8_lossy(&body)
            .trim_end_matches('\0')
            .to_owned()
    }))
}

/// A startup-phase message (no type byte): its body after the length.
fn read_startup(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0; 4];
    stream.read_exact(&mut len)?;
    let mut body = vec![0; (u32::from_be_bytes(len) as usize).saturating_sub(4)];
    stream.read_exact(&mut body)?;
    Ok(body)
}

/// `outbox status` against `url`, with `extra` arguments first; its success and stderr.
fn status(url: &str, extra: &[&str]) -> Result<(bool, String)> {
    let output = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(extra)
        .arg("status")
        .env("DATABASE_URL", url)
        .env_remove("PGSSLMODE")
        .env_remove("OUTBOX_INSECURE_TRANSPORT")
        .output()?;
    Ok((
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    ))
}

/// Fails before the fix: `outbox status` connected with sqlx's default `prefer`, took the
/// "no TLS" answer and sent `hunter2`.
#[test]
fn the_password_never_reaches_a_server_that_refuses_tls() -> Result<()> {
    let server = FakeServer::start()?;
    let port = server.port;
    for url in [
        format!("postgres://u:hunter2@127.0.0.1:{port}/db"),
        format!("postgres://u:hunter2@localhost:{port}/db?sslmode=prefer"),
        format!("postgres://u:hunter2@127.0.0.1:{port}/db?sslmode=require"),
        format!("postgres://u:hunter2@127.0.0.1:{port}/db?sslmode=verify-ca"),
    ] {
        let (ok, stderr) = status(&url, &[])?;
        assert!(!ok, "{url}: {stderr}");
        assert!(
            stderr.contains("sslmode=verify-full") && stderr.contains("--insecure-transport"),
            "{url}: {stderr}"
        );
        assert!(!stderr.contains("hunter2"), "{stderr}");
    }
    assert_eq!(
        server
            .passwords
            .recv_timeout(Duration::from_millis(500))
            .ok(),
        None,
        "a password was sent"
    );
    // The switch says the user accepts it: the server here does catch what is sent.
    let url = format!("postgres://u:hunter2@127.0.0.1:{port}/db");
    let (ok, _) = status(&url, &["--insecure-transport"])?;
    assert!(!ok, "the fake server is no database");
    assert_eq!(
        server.passwords.recv_timeout(Duration::from_secs(10)).ok(),
        Some("hunter2".to_owned())
    );
    Ok(())
}

/// SASL credentials over a listener without TLS, or over TLS that checks nothing, are refused
/// before any client is made.
#[test]
fn sasl_credentials_without_verified_tls_are_refused() -> Result<()> {
    let url = outbox_tests::database_url();
    for extra in [
        vec!["-X", "sasl.password=pw"],
        vec![
            "-X",
            "security.protocol=SASL_PLAINTEXT",
            "-X",
            "sasl.password=pw",
        ],
        vec![
            "-X",
            "security.protocol=SASL_SSL",
            "-X",
            "enable.ssl.certificate.verification=false",
            "-X",
            "sasl.password=pw",
        ],
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_outbox"))
            .args([
                "quarantine",
                "requeue",
                "consumer",
                "1",
                "--brokers",
                "127.0.0.1:9",
            ])
            .args(&extra)
            .env("DATABASE_URL", &url)
            .env_remove("OUTBOX_INSECURE_TRANSPORT")
            .output()?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{extra:?}: {stderr}");
        assert!(
            stderr.contains("SASL") && stderr.contains("--insecure-transport"),
            "{extra:?}: {stderr}"
        );
    }
    Ok(())
}
