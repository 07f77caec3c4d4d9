//! The test broker's secured listeners (scripts/kafka-node): SASL_SSL with SCRAM-SHA-512 and
//! OAUTHBEARER, and SSL requiring a client certificate; the certificates scripts/tls.sh made.

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use rdkafka::ClientConfig;

/// Where the secured listeners are and what authenticates to them, from the environment
/// scripts/services.sh exports.
#[derive(Debug, Clone)]
pub struct SecureKafka {
    /// SASL_SSL listener (SCRAM-SHA-512, OAUTHBEARER).
    pub sasl_ssl: String,
    /// SSL listener requiring a client certificate.
    pub mtls: String,
    /// scripts/tls.sh's directory.
    pub tls_dir: PathBuf,
    /// The SCRAM user.
    pub user: String,
    /// Its password.
    pub password: String,
}

fn env(name: &str) -> Result<String> {
    std::env::var(name).with_context(|| {
        format!(
            "{name} is not set: run the tests through scripts/test (source scripts/services.sh)"
        )
    })
}

impl SecureKafka {
    /// Read from `OUTBOX_TEST_KAFKA_SASL_SSL`, `OUTBOX_TEST_KAFKA_MTLS`, `OUTBOX_TEST_TLS_DIR`,
    /// `OUTBOX_TEST_KAFKA_SCRAM_USER` and `OUTBOX_TEST_KAFKA_SCRAM_PASSWORD_FILE`.
    pub fn from_env() -> Result<Self> {
        let password_file = env("OUTBOX_TEST_KAFKA_SCRAM_PASSWORD_FILE")?;
        Ok(Self {
            sasl_ssl: env("OUTBOX_TEST_KAFKA_SASL_SSL")?,
            mtls: env("OUTBOX_TEST_KAFKA_MTLS")?,
            tls_dir: env("OUTBOX_TEST_TLS_DIR")?.into(),
            user: env("OUTBOX_TEST_KAFKA_SCRAM_USER")?,
            password: std::fs::read_to_string(&password_file)
                .with_context(|| format!("reading {password_file}"))?
                .trim()
                .to_owned(),
        })
    }

    /// A file of the TLS directory, as a string for librdkafka.
    pub fn tls_file(&self, name: &str) -> String {
        self.tls_dir.join(name).to_string_lossy().into_owned()
    }

    /// SASL_SSL with SCRAM-SHA-512 as the scripts' user, trusting the test authority.
    pub fn scram(&self) -> ClientConfig {
        self.scram_with(&self.password, "ca.pem")
    }

    /// SASL_SSL with SCRAM-SHA-512 with `password`, trusting the authority in `ca`.
    pub fn scram_with(&self, password: &str, ca: &str) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.sasl_ssl)
            .set("security.protocol", "SASL_SSL")
            .set("sasl.mechanisms", "SCRAM-SHA-512")
            .set("sasl.username", &self.user)
            .set("sasl.password", password)
            .set("ssl.ca.location", self.tls_file(ca));
        config
    }

    /// SSL with the client certificate, its key decrypted with its password.
    pub fn mtls(&self) -> Result<ClientConfig> {
        let key_password = std::fs::read_to_string(self.tls_dir.join("client.key.password"))?;
        let mut config = self.mtls_without_certificate();
        config
            .set("ssl.certificate.location", self.tls_file("client.pem"))
            .set("ssl.key.location", self.tls_file("client.key"))
            .set("ssl.key.password", key_password.trim());
        Ok(config)
    }

    /// SSL to the mTLS listener with no client certificate (which it refuses).
    pub fn mtls_without_certificate(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.mtls)
            .set("security.protocol", "SSL")
            .set("ssl.ca.location", self.tls_file("ca.pem"));
        config
    }

    /// SASL_SSL with OAUTHBEARER: the token comes from the client's context.
    pub fn oauthbearer(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.sasl_ssl)
            .set("security.protocol", "SASL_SSL")
            .set("sasl.mechanisms", "OAUTHBEARER")
            .set("ssl.ca.location", self.tls_file("ca.pem"));
        config
    }
}

/// An unsecured JWT (`alg: none`) for `subject`, valid for `lifetime`, as Kafka's
/// `OAuthBearerUnsecuredValidatorCallbackHandler` accepts; and its expiry in ms since the epoch.
pub fn unsecured_token(subject: &str, lifetime: Duration) -> (String, i64) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let expiry = now + lifetime;
    let header = URL_SAFE_NO_PAD.encode(br#"{"alg":"none"}"#);
    let claims = serde_json::json!({
        "sub": subject,
        "iat": now.as_secs(),
        "exp": expiry.as_secs(),
    });
    let claims = URL_SAFE_NO_PAD.encode(claims.to_string());
    (
        format!("{header}.{claims}."),
        i64::try_from(expiry.as_millis()).unwrap_or(i64::MAX),
    )
}
