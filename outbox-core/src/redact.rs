//! Kafka client errors told without the secrets they may quote.
//!
//! rdkafka's `KafkaError::ClientConfig` carries the refused property's value, and its
//! `Display` prints it: `ssl.key.password=<secret>` refused by a build would end up in a log.

use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;

const REDACTED: &str = "<redacted>";

/// `error` as text, with the value of the property it names and of every property of
/// `config` replaced by `<redacted>`, wherever they appear in it.
pub fn kafka_error(error: &KafkaError, config: &ClientConfig) -> String {
    let text = match error {
        KafkaError::ClientConfig(_, description, key, _) => {
            format!("the Kafka client refused property {key}: {description}")
        }
        other => other.to_string(),
    };
    // `config_map` hides secrets' values (the ones that matter here); `get` gives them.
    let mut values: Vec<&str> = config
        .config_map()
        .into_keys()
        .filter_map(|key| config.get(key))
        .chain(match error {
            KafkaError::ClientConfig(_, _, _, value) => Some(value.as_str()),
            _ => None,
        })
        // A value of a few characters ("1", "all") is no secret and would garble the text.
        .filter(|value| value.len() >= 4)
        .collect();
    // Longest first, so a value containing another is replaced whole.
    values.sort_by_key(|value| std::cmp::Reverse(value.len()));
    values
        .into_iter()
        .fold(text, |text, value| text.replace(value, REDACTED))
}

#[cfg(test)]
mod tests {
    use rdkafka::consumer::BaseConsumer;

    use super::*;

    #[test]
    fn a_refused_value_and_the_configurations_secrets_are_not_quoted() {
        let secret = "hunter2-e3b0c442";
        let mut config = ClientConfig::new();
        config
            .set("sasl.password", "another-secret-98f1")
            // Refused, and librdkafka quotes the value in its description.
            .set("security.protocol", secret);
        let Err(error) = config.create::<BaseConsumer>() else {
            panic!("a protocol of that name is refused");
        };
        assert!(
            error.to_string().contains(secret),
            "rdkafka quotes it: {error}"
        );
        let text = kafka_error(&error, &config);
        assert!(!text.contains(secret), "{text}");
        assert!(!text.contains("another-secret-98f1"), "{text}");
        assert!(
            text.contains("security.protocol"),
            "names the property: {text}"
        );
    }
}
