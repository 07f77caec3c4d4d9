//! The Kafka client configuration of the commands that talk to Kafka, from librdkafka
//! properties given the ways kcat and Confluent's images take them, with secrets kept out of
//! the process list.
//!
//! Applied in this order, a later source overriding an earlier one:
//! 1. the command's defaults;
//! 2. the properties file of `-F/--kafka-config` or `OUTBOX_KAFKA_CONFIG` (`key=value` lines,
//!    `#` comments, blank lines; spaces around keys and values are ignored);
//! 3. environment variables `OUTBOX_KAFKA_<KEY>`, the key upper-cased with dots as
//!    underscores (`OUTBOX_KAFKA_SASL_PASSWORD` is `sasl.password`); a variable naming no
//!    librdkafka property is ignored with a warning (naming the variable, not its value);
//! 4. `--brokers` (`KAFKA_BROKERS`), as `bootstrap.servers`;
//! 5. each `-X key=value`, in order.
//!
//! Any value written `file:PATH` is read from that file (one trailing newline dropped): a
//! secret then appears in no argument and no environment. A secret key (`*.password`,
//! `*.secret`, `ssl.key.pem`, ...) given with `-X` and a literal value draws a warning, since
//! every user of the machine can read a process's arguments.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use outbox_core::kafka_secrets::is_secret_key;
use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaConfRes;

/// The prefix of the environment variables that carry properties.
const ENV_PREFIX: &str = "OUTBOX_KAFKA_";
/// The variable naming the properties file, which is not a property.
const ENV_CONFIG_FILE: &str = "OUTBOX_KAFKA_CONFIG";
/// A value read from a file.
const FILE_PREFIX: &str = "file:";

/// How a command that talks to Kafka is configured.
#[derive(Debug, Args)]
pub(crate) struct KafkaArgs {
    /// Kafka bootstrap servers, `host:port[,host:port...]`; a shorthand for
    /// `-X bootstrap.servers=...`.
    #[arg(long, env = "KAFKA_BROKERS")]
    brokers: Option<String>,
    /// A librdkafka properties file: `key=value` lines, `#` comments. Applied before the
    /// `OUTBOX_KAFKA_*` variables, `--brokers` and `-X`.
    #[arg(short = 'F', long, env = ENV_CONFIG_FILE, value_name = "FILE")]
    kafka_config: Option<PathBuf>,
    /// A librdkafka property, `key=value` (repeatable; last wins). A value `file:PATH` is
    /// read from PATH: pass secrets that way, in the config file or as `OUTBOX_KAFKA_<KEY>`
    /// (`OUTBOX_KAFKA_SASL_PASSWORD`), never literally here, where the process list shows
    /// them.
    #[arg(short = 'X', value_name = "KEY=VALUE")]
    property: Vec<String>,
}

/// Where a property came from, for messages (never its value).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Origin {
    File(PathBuf, usize),
    Env(String),
    Brokers,
    Argument,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::File(path, line) => write!(f, "{} line {line}", path.display()),
            Self::Env(name) => f.write_str(name),
            Self::Brokers => f.write_str("--brokers"),
            Self::Argument => f.write_str("-X"),
        }
    }
}

/// One property as given: its value may still be a `file:` reference.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Property {
    key: String,
    value: String,
    origin: Origin,
}

impl KafkaArgs {
    /// `base` with every property given applied, in the module's order; `file:` values read.
    /// SASL credentials without verified TLS are refused unless `--insecure-transport`.
    /// Prints a warning for each secret given literally with `-X` and each `OUTBOX_KAFKA_*`
    /// variable that names no property.
    pub(crate) fn client_config(&self, base: ClientConfig) -> Result<ClientConfig> {
        let mut properties = Vec::new();
        if let Some(path) = &self.kafka_config {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read the Kafka config file {}", path.display()))?;
            properties.extend(parse_file(&text, path)?);
        }
        let (from_env, ignored) = from_env(std::env::vars());
        for name in ignored {
            eprintln!(
                "warning: ignoring {name}: {} is not a librdkafka property",
                env_key(&name)
            );
        }
        properties.extend(from_env);
        if let Some(brokers) = &self.brokers {
            properties.push(Property {
                key: "bootstrap.servers".to_owned(),
                value: brokers.clone(),
                origin: Origin::Brokers,
            });
        }
        for argument in &self.property {
            let property = parse_argument(argument)?;
            if let Some(warning) = literal_secret_warning(&property) {
                eprintln!("{warning}");
            }
            properties.push(property);
        }
        let mut config = base;
        for property in properties {
            let value = resolve(&property)?;
            config.set(property.key, value);
        }
        if !crate::insecure_transport() {
            outbox_core::check_kafka_tls(&config).context(
                "refusing the Kafka configuration (--insecure-transport accepts the risk)",
            )?;
        }
        Ok(config)
    }
}

/// The bootstrap servers `config` names; an error saying how to give them when it names none.
pub(crate) fn bootstrap_servers(config: &ClientConfig) -> Result<String> {
    match config.get("bootstrap.servers") {
        Some(servers) if !servers.trim().is_empty() => Ok(servers.to_owned()),
        _ => bail!(
            "no Kafka brokers: pass --brokers (or set KAFKA_BROKERS), -X bootstrap.servers=..., \
             or put bootstrap.servers in the --kafka-config file"
        ),
    }
}

/// The properties of a file's `text` (read from `path`). A line that is not `key=value` is an
/// error naming the line, not showing it (it may hold a secret).
fn parse_file(text: &str, path: &Path) -> Result<Vec<Property>> {
    let mut properties = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let origin = Origin::File(path.to_owned(), i + 1);
        let Some((key, value)) = split(line) else {
            bail!("{origin}: expected key=value");
        };
        properties.push(Property { key, value, origin });
    }
    Ok(properties)
}

/// `key=value` with a non-empty key, both trimmed.
fn split(text: &str) -> Option<(String, String)> {
    let (key, value) = text.split_once('=')?;
    let key = key.trim();
    (!key.is_empty()).then(|| (key.to_owned(), value.trim().to_owned()))
}

/// One `-X` argument. The error does not show it (it may hold a secret).
fn parse_argument(argument: &str) -> Result<Property> {
    let Some((key, value)) = split(argument) else {
        bail!(
            "-X takes key=value (a librdkafka property), and got an argument without a key and '='"
        );
    };
    Ok(Property {
        key,
        value,
        origin: Origin::Argument,
    })
}

/// The property an `OUTBOX_KAFKA_*` variable stands for.
fn env_key(name: &str) -> String {
    name[ENV_PREFIX.len()..]
        .to_ascii_lowercase()
        .replace('_', ".")
}

/// The properties among `vars`, and the names of the `OUTBOX_KAFKA_*` variables that name
/// none librdkafka knows (other tools' variables share the prefix).
fn from_env(vars: impl Iterator<Item = (String, String)>) -> (Vec<Property>, Vec<String>) {
    let mut vars: Vec<(String, String)> = vars
        .filter(|(name, _)| name.starts_with(ENV_PREFIX) && name != ENV_CONFIG_FILE)
        .filter(|(name, _)| name.len() > ENV_PREFIX.len())
        .collect();
    // Deterministic, whatever order the environment has.
    vars.sort();
    let (mut properties, mut ignored) = (Vec::new(), Vec::new());
    for (name, value) in vars {
        let key = env_key(&name);
        if is_known(&key) {
            properties.push(Property {
                key,
                value,
                origin: Origin::Env(name),
            });
        } else {
            ignored.push(name);
        }
    }
    (properties, ignored)
}

/// Whether librdkafka knows the property `key` (global or topic-level).
fn is_known(key: &str) -> bool {
    // An empty value: setting some properties has effects (loading plugins).
    !matches!(
        ClientConfig::new().set(key, "").create_native_config(),
        Err(KafkaError::ClientConfig(
            RDKafkaConfRes::RD_KAFKA_CONF_UNKNOWN,
            ..
        ))
    )
}

/// The warning for a secret key given literally on the command line, if `property` is one.
fn literal_secret_warning(property: &Property) -> Option<String> {
    (property.origin == Origin::Argument
        && is_secret_key(&property.key)
        && !property.value.starts_with(FILE_PREFIX))
    .then(|| {
        format!(
            "warning: -X {key}=... puts a secret where every user of this machine can read it \
             (the process list); give it as -X {key}=file:PATH, in the --kafka-config file, \
             or as {ENV_PREFIX}{env}",
            key = property.key,
            env = property.key.to_ascii_uppercase().replace('.', "_"),
        )
    })
}

/// The value of `property`, read from its file if it is `file:PATH` (without one trailing
/// newline, which editors and `echo` add).
fn resolve(property: &Property) -> Result<String> {
    let Some(path) = property.value.strip_prefix(FILE_PREFIX) else {
        return Ok(property.value.clone());
    };
    let mut value = std::fs::read_to_string(path).with_context(|| {
        format!(
            "cannot read the value of {} ({}) from {path}",
            property.key, property.origin
        )
    })?;
    if value.ends_with('\n') {
        value.pop();
        if value.ends_with('\r') {
            value.pop();
        }
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(properties: &[Property]) -> Vec<(&str, &str)> {
        properties
            .iter()
            .map(|p| (p.key.as_str(), p.value.as_str()))
            .collect()
    }

    #[test]
    fn a_file_has_properties_comments_and_blank_lines() -> Result<()> {
        let text = "# the cluster\n\nbootstrap.servers = kafka-1:9093,kafka-2:9093\n  security.protocol=SASL_SSL\r\nsasl.password=a=b#c\n";
        let parsed = parse_file(text, Path::new("k.properties"))?;
        assert_eq!(
            pairs(&parsed),
            [
                ("bootstrap.servers", "kafka-1:9093,kafka-2:9093"),
                ("security.protocol", "SASL_SSL"),
                // Only the first '=' splits; '#' inside a value is the value's.
                ("sasl.password", "a=b#c"),
            ]
        );
        assert_eq!(
            parsed[1].origin,
            Origin::File(PathBuf::from("k.properties"), 4)
        );
        Ok(())
    }

    #[test]
    fn a_bad_line_is_named_by_number_not_shown() {
        let error = parse_file("a=1\nhunter2\n", Path::new("k.properties"))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(error, "k.properties line 2: expected key=value");
        let error = parse_argument("hunter2")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(!error.is_empty() && !error.contains("hunter2"), "{error}");
        assert!(parse_argument("=x").is_err());
    }

    #[test]
    fn environment_variables_name_properties_and_others_are_set_aside() {
        let vars = [
            ("OUTBOX_KAFKA_SASL_PASSWORD", "pw"),
            ("OUTBOX_KAFKA_SECURITY_PROTOCOL", "SASL_SSL"),
            ("OUTBOX_KAFKA_MESSAGE_TIMEOUT_MS", "5000"),
            ("OUTBOX_KAFKA_CONFIG", "/etc/outbox/kafka.properties"),
            ("OUTBOX_KAFKA_CLASSPATH_FILE", "/tmp/cp"),
            ("OUTBOX_KAFKA_", "x"),
            ("KAFKA_SASL_PASSWORD", "not ours"),
        ]
        .map(|(n, v)| (n.to_owned(), v.to_owned()));
        let (properties, ignored) = from_env(vars.into_iter());
        assert_eq!(
            pairs(&properties),
            [
                ("message.timeout.ms", "5000"),
                ("sasl.password", "pw"),
                ("security.protocol", "SASL_SSL"),
            ]
        );
        assert_eq!(ignored, ["OUTBOX_KAFKA_CLASSPATH_FILE"]);
    }

    #[test]
    fn only_literal_secrets_on_the_command_line_draw_a_warning() -> Result<()> {
        let warning = |arg: &str| -> Result<Option<String>> {
            Ok(literal_secret_warning(&parse_argument(arg)?))
        };
        let shown = warning("sasl.password=hunter2")?.unwrap_or_default();
        assert!(
            shown.contains("sasl.password") && shown.contains("OUTBOX_KAFKA_SASL_PASSWORD"),
            "{shown}"
        );
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(warning("ssl.key.pem=-----BEGIN")?.is_some());
        assert!(warning("sasl.oauthbearer.client.secret=s")?.is_some());
        assert_eq!(warning("sasl.password=file:/run/secrets/kafka")?, None);
        assert_eq!(warning("sasl.username=relay")?, None);
        let from_file = Property {
            origin: Origin::File(PathBuf::from("k"), 1),
            ..parse_argument("sasl.password=pw")?
        };
        assert_eq!(literal_secret_warning(&from_file), None);
        Ok(())
    }

    #[test]
    fn file_values_are_read_without_the_trailing_newline() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("outbox-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("password");
        std::fs::write(&path, "pa ss\n")?;
        let property = parse_argument(&format!("sasl.password=file:{}", path.display()))?;
        assert_eq!(resolve(&property)?, "pa ss");
        std::fs::write(&path, "crlf\r\n\n")?;
        assert_eq!(resolve(&property)?, "crlf\r\n", "one newline only");
        let missing = parse_argument("sasl.password=file:/nonexistent/pw")?;
        let error = format!("{:#}", resolve(&missing).err().context("read")?);
        assert!(
            error.contains("sasl.password") && error.contains("/nonexistent/pw"),
            "{error}"
        );
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
