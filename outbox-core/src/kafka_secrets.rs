//! Kafka clients built from a user's configuration without echoing its secrets.
//!
//! rdkafka's [`KafkaError::ClientConfig`] carries the value librdkafka refused and shows it
//! (`Client config error: {description} {key} {value}`), and librdkafka's description can
//! quote it too (`Unsupported value "..."`). A password set under a misspelt key, or a
//! property this build does not support, would end up in the error an application logs.
//! Every client the framework builds from a caller's `ClientConfig` is made through
//! [`create`] or [`create_with_context`], which keep the key and the description and put
//! [`REDACTED`] in place of the value. librdkafka's own log lines do not need this: its
//! configuration dump (`debug=conf`) writes its sensitive properties as `[redacted]`, and its
//! configuration warnings show values of plain settings only (timeouts, the SASL mechanism).

use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::config::{FromClientConfig, FromClientConfigAndContext};
use rdkafka::error::KafkaError;

/// What stands in an error for a value it must not show.
pub const REDACTED: &str = "<redacted>";

/// Whether a librdkafka property's value is a secret by its name: passwords, passphrases,
/// client secrets, private keys in PEM, and `sasl.oauthbearer.config` (which can carry
/// credentials). Case-insensitive.
///
/// ```
/// use outbox_core::kafka_secrets::is_secret_key;
/// assert!(is_secret_key("sasl.password") && is_secret_key("ssl.key.pem"));
/// assert!(!is_secret_key("ssl.ca.location") && !is_secret_key("sasl.username"));
/// ```
pub fn is_secret_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    ["password", "passphrase", "secret"]
        .iter()
        .any(|end| key.ends_with(end))
        || (key.ends_with("key.pem"))
        || key == "sasl.oauthbearer.config"
}

/// `error` from building a client of `config`, with no value of `config` it could echo: a
/// [`KafkaError::ClientConfig`] keeps its code, key and description, with the value (and any
/// occurrence of it in the description) replaced by [`REDACTED`]; in it and in a
/// [`KafkaError::ClientCreation`], the values of `config`'s secret keys ([`is_secret_key`])
/// are replaced too. Other errors are returned as they are.
pub fn redact_error(error: KafkaError, config: &ClientConfig) -> KafkaError {
    match error {
        KafkaError::ClientConfig(code, description, key, value) => KafkaError::ClientConfig(
            code,
            redact_in(description, config, Some(&value)),
            key,
            REDACTED.to_owned(),
        ),
        KafkaError::ClientCreation(message) => {
            KafkaError::ClientCreation(redact_in(message, config, None))
        }
        other => other,
    }
}

/// `text` with `value` and the values of `config`'s secret keys replaced by [`REDACTED`].
fn redact_in(mut text: String, config: &ClientConfig, value: Option<&str>) -> String {
    let map = config.config_map();
    let secrets = map
        .keys()
        .filter(|key| is_secret_key(key))
        .filter_map(|key| config.get(key));
    for secret in value.into_iter().chain(secrets) {
        if !secret.is_empty() {
            text = text.replace(secret, REDACTED);
        }
    }
    text
}

/// `config.create()`, with an error that echoes no value ([`redact_error`]).
pub fn create<T: FromClientConfig>(config: &ClientConfig) -> Result<T, KafkaError> {
    config.create().map_err(|e| redact_error(e, config))
}

/// `config.create_with_context(context)`, with an error that echoes no value
/// ([`redact_error`]).
pub fn create_with_context<C, T>(config: &ClientConfig, context: C) -> Result<T, KafkaError>
where
    C: ClientContext,
    T: FromClientConfigAndContext<C>,
{
    config
        .create_with_context(context)
        .map_err(|e| redact_error(e, config))
}

#[cfg(test)]
mod tests {
    use rdkafka::producer::BaseProducer;

    use super::*;

    const SECRET: &str = "hunter2-Zq8x";

    fn refused(config: &ClientConfig) -> String {
        match create::<BaseProducer>(config) {
            Ok(_) => panic!("librdkafka accepted {config:?}"),
            Err(e) => format!("{e} / {e:?}"),
        }
    }

    #[test]
    fn a_secret_under_an_unknown_key_is_not_echoed_and_the_key_is_named() {
        let mut config = ClientConfig::new();
        config.set("sasl.pasword", SECRET);
        let raw = config
            .create::<BaseProducer>()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        // Why this module exists; if an rdkafka upgrade stops echoing values, it can go.
        assert!(raw.contains(SECRET), "rdkafka echoes it: {raw}");
        let shown = refused(&config);
        assert!(!shown.contains(SECRET), "{shown}");
        assert!(
            shown.contains("sasl.pasword") && shown.contains(REDACTED),
            "{shown}"
        );
    }

    #[test]
    fn a_value_quoted_in_the_description_is_redacted_there_too() {
        let mut config = ClientConfig::new();
        config.set("security.protocol", SECRET);
        let shown = refused(&config);
        assert!(!shown.contains(SECRET), "{shown}");
        assert!(shown.contains("security.protocol"), "{shown}");
    }

    #[test]
    fn secret_values_of_the_config_are_redacted_from_creation_errors() {
        let mut config = ClientConfig::new();
        config.set("ssl.key.password", SECRET);
        let error = redact_error(
            KafkaError::ClientCreation(format!("ssl.key.location failed: wrong pass {SECRET}")),
            &config,
        );
        assert_eq!(
            error.to_string(),
            "Client creation error: ssl.key.location failed: wrong pass <redacted>"
        );
    }

    #[test]
    fn secret_keys_are_told_by_name() {
        for key in [
            "sasl.password",
            "ssl.key.password",
            "ssl.keystore.password",
            "SSL.Truststore.Password",
            "sasl.oauthbearer.client.secret",
            "ssl.key.pem",
            "sasl.oauthbearer.assertion.private.key.pem",
            "sasl.oauthbearer.assertion.private.key.passphrase",
            "sasl.oauthbearer.config",
        ] {
            assert!(is_secret_key(key), "{key}");
        }
        for key in [
            "bootstrap.servers",
            "security.protocol",
            "sasl.mechanism",
            "sasl.username",
            "ssl.ca.location",
            "ssl.key.location",
            "ssl.certificate.pem",
        ] {
            assert!(!is_secret_key(key), "{key}");
        }
    }
}
