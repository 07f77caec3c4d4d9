//! The partition a Java Kafka client (Debezium, Kafka Connect, Kafka Streams) chooses for a
//! keyed record: `toPositive(murmur2(key)) % partitions`, as in
//! `org.apache.kafka.clients.producer.internals.BuiltInPartitioner`, and librdkafka's
//! `murmur2_random` for a non-null key. The relay enforces that partitioner, so it can tell
//! which partition a row's record goes to before sending it.

/// Kafka's `Utils.murmur2`: MurmurHash2, 32 bits, seed `0x9747b28c`.
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let mut h: u32 = SEED ^ data.len() as u32;
    let mut chunks = data.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        for (i, byte) in tail.iter().enumerate().rev() {
            h ^= u32::from(*byte) << (8 * i);
        }
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition of `key` among `partitions` (more than zero), as a Java producer picks it.
pub fn java_partition(key: &[u8], partitions: i32) -> i32 {
    (murmur2(key) & 0x7fff_ffff) % partitions
}

#[cfg(test)]
mod tests {
    use super::murmur2;

    /// The vectors of Kafka's own `UtilsTest.testMurmur2`.
    #[test]
    fn matches_kafkas_test_vectors() {
        let cases: [(&str, i32); 6] = [
            ("21", -973_932_308),
            ("foobar", -790_332_482),
            ("a-little-bit-long-string", -985_981_536),
            ("a-little-bit-longer-string", -1_486_304_829),
            (
                "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58_897_971,
            ),
            ("abc", 479_470_107),
        ];
        for (input, expected) in cases {
            assert_eq!(murmur2(input.as_bytes()), expected, "murmur2({input:?})");
        }
    }
}
