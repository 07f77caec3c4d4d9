//! The partial outage: one node of the three-node cluster down while Metadata keeps answering.
//!
//! First the topic still takes writes (replication 3, `min.insync.replicas` 2): what is
//! committed while the node is down must flow while it is still down, so this figure is timed
//! from the kill and bounded by the downtime. Then the topic refuses writes (its
//! `min.insync.replicas` raised to 3): every produce fails with `NOT_ENOUGH_REPLICAS` while
//! every partition keeps a leader. That is an outage of the partitions, to be waited out, not
//! a failure of the rows: the relays run with a quarantine budget (5 attempts of 5 s
//! deliveries) shorter than the downtime, and nothing may be quarantined for it. That figure
//! is timed from the node's return.

use std::time::{Duration, Instant};

use anyhow::Result;

use super::{Figure, LongFaultPhase};
use crate::broker::Down;
use crate::fleet::lock;
use crate::kafka::set_topic_configs;
use crate::summary::Kind;

impl LongFaultPhase<'_> {
    pub(super) async fn partial_outage(&mut self, downtime: Duration) -> Result<Vec<Figure>> {
        let brokers = self.broker.address();
        // A node the fault loop restarted may still be starting: the fault takes one node of
        // a whole cluster down, not a second one.
        self.broker.wait_ready().await?;
        let node = self.take_down_leader(downtime).await?;
        let down = Instant::now();
        lock(self.fleet).counts.add(Kind::PartialOutage, 1);
        tracing::info!(
            node,
            ?downtime,
            "long fault: one node of three killed; the topic still takes writes"
        );
        let watermark = self.mark().await?;
        let writable = self.time_drain(watermark, None, down).await?;
        if writable >= downtime {
            tracing::warn!(?writable, "the backlog flowed only once the node was back");
        }
        self.broker.wait_ready().await?;

        let mut configs = self.topic_spec.configs.to_vec();
        configs.push(("min.insync.replicas", "3"));
        set_topic_configs(&brokers, self.topic, &configs).await?;
        let node = self.take_down_leader(downtime).await?;
        lock(self.fleet).counts.add(Kind::IsrOutage, 1);
        tracing::info!(
            node,
            ?downtime,
            "long fault: one node of three killed; the topic refuses writes (min.insync.replicas 3)"
        );
        self.broker.wait_ready().await?;
        let back = Instant::now();
        tracing::info!(
            quarantined = self.quarantined().await?,
            "long fault: the node serves again"
        );
        let watermark = self.mark().await?;
        let refused = self.time_drain(watermark, None, back).await?;
        configs.pop();
        configs.push(("min.insync.replicas", "2"));
        set_topic_configs(&brokers, self.topic, &configs).await?;
        Ok(vec![
            (Kind::PartialOutage, writable),
            (Kind::IsrOutage, refused),
        ])
    }

    /// Takes down the leader of partition 0 for `downtime`. Just after a node came back, a
    /// partition can be without a leader for a moment: asked again until one is named.
    async fn take_down_leader(&mut self, downtime: Duration) -> Result<u32> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match self
                .broker
                .restart_leader(self.topic, 0, Down::Kill9, downtime)
                .await
            {
                Ok(node) => return Ok(node),
                Err(error) if Instant::now() < deadline => {
                    tracing::info!(%error, "no leader to take down yet; asking again");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(error) => return Err(error),
            }
        }
    }
}
