//! The run's own Kafka cluster: one node (the CI and long profiles) or three (the cluster
//! profile: replication factor 3, `min.insync.replicas` 2), each a [`Broker`] on free ports.
//! A broker fault takes down the node leading a partition of the run's topic: with one node
//! that is the broker itself, with three a leader whose partition fails over to a follower
//! while the relays (idempotent, `acks=all`) and the consumers keep going.

use std::path::Path;
use std::time::Duration;

use anyhow::{Result, bail};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};

use crate::broker::{Broker, Down, NodeSpec, free_ports, new_cluster_id};

/// The cluster's nodes, ids 1..=n.
#[derive(Debug)]
pub(crate) struct Cluster {
    nodes: Vec<Broker>,
}

impl Cluster {
    /// Starts `size` nodes under `run_dir` (`kafka/` for one node, `kafka/node<id>/` for
    /// more) and waits until every one lists the whole cluster.
    pub(crate) async fn start(run_dir: &Path, size: usize) -> Result<Self> {
        let ports = free_ports(2 * size)?;
        let (ports, controller_ports) = ports.split_at(size);
        let voters = (1..)
            .zip(controller_ports)
            .map(|(id, port)| format!("{id}@127.0.0.1:{port}"))
            .collect::<Vec<_>>()
            .join(",");
        let cluster_id = new_cluster_id();
        let mut nodes = Vec::with_capacity(size);
        for (i, (&port, &controller_port)) in ports.iter().zip(controller_ports).enumerate() {
            let node_id = u32::try_from(i + 1)?;
            let dir = if size == 1 {
                run_dir.join("kafka")
            } else {
                run_dir.join("kafka").join(format!("node{node_id}"))
            };
            nodes.push(Broker::start(NodeSpec {
                node_id,
                port,
                controller_port,
                voters: voters.clone(),
                cluster_id: cluster_id.clone(),
                replication: size,
                dir,
            })?);
        }
        let mut cluster = Self { nodes };
        cluster.wait_ready().await?;
        Ok(cluster)
    }

    /// Number of nodes.
    pub(crate) fn size(&self) -> usize {
        self.nodes.len()
    }

    /// The bootstrap list: every node.
    pub(crate) fn address(&self) -> String {
        self.nodes
            .iter()
            .map(Broker::address)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Fails if a node exited without being asked to; starts again nodes whose restart
    /// downtime is over.
    pub(crate) async fn check_alive(&mut self) -> Result<()> {
        for node in &mut self.nodes {
            node.check_alive().await?;
        }
        Ok(())
    }

    /// Whether every node serves requests (see [`Broker::poll_ready`]).
    pub(crate) async fn poll_ready(&mut self) -> Result<bool> {
        let mut all = true;
        for node in &mut self.nodes {
            all &= node.poll_ready().await?;
        }
        Ok(all)
    }

    /// Waits until every node is ready. Every restart under way is finished first: a node is
    /// ready when its metadata lists every node, so waiting on one while another's restart
    /// had not been started again would wait for nothing (a CI run of the partial outage
    /// timed out so, a node restarted by the fault loop still starting when another was
    /// taken down).
    pub(crate) async fn wait_ready(&mut self) -> Result<()> {
        for node in &mut self.nodes {
            node.finish_restart().await?;
        }
        for node in &mut self.nodes {
            node.wait_ready().await?;
        }
        Ok(())
    }

    /// Stops the cluster for good. One node stops cleanly; several are killed, because a
    /// controlled shutdown needs a controller quorum that the first stops would take away.
    pub(crate) async fn stop(&mut self) -> Result<()> {
        if let [node] = self.nodes.as_mut_slice() {
            return node.stop().await;
        }
        for node in &mut self.nodes {
            node.kill().await?;
        }
        Ok(())
    }

    /// Takes down the node leading `partition` of `topic` (`how`) and starts it again after
    /// `downtime` (see [`Broker::restart`]); returns its id.
    pub(crate) async fn restart_leader(
        &mut self,
        topic: &str,
        partition: i32,
        how: Down,
        downtime: Duration,
    ) -> Result<u32> {
        let leader = if self.nodes.len() == 1 {
            1
        } else {
            leader_of(self.address(), topic.to_owned(), partition).await?
        };
        let Some(node) = self.nodes.iter_mut().find(|n| n.node_id() == leader) else {
            bail!("partition {partition} of {topic} is led by unknown node {leader}");
        };
        node.restart(how, downtime);
        Ok(leader)
    }
}

/// The current leader of `partition` of `topic`, from a metadata request.
async fn leader_of(brokers: String, topic: String, partition: i32) -> Result<u32> {
    tokio::task::spawn_blocking(move || {
        let client: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .create()?;
        let metadata = client.fetch_metadata(Some(&topic), Duration::from_secs(10))?;
        let leader = metadata
            .topics()
            .iter()
            .find(|t| t.name() == topic)
            .and_then(|t| t.partitions().iter().find(|p| p.id() == partition))
            .map(rdkafka::metadata::MetadataPartition::leader);
        match leader {
            Some(id) if id >= 0 => Ok(u32::try_from(id)?),
            other => bail!("no leader for partition {partition} of {topic}: {other:?}"),
        }
    })
    .await?
}
