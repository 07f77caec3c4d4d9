import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.Future;

import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.serialization.StringSerializer;

/**
 * Kafka's own Java producer, for tests that need records a client other than librdkafka
 * wrote. Argument: the bootstrap servers. Each line on stdin is one record, tab-separated:
 * compression type, topic, key, id header, value. One producer per compression type; each
 * producer sends its records in batches (linger.ms), so they are compressed together. Prints
 * one line per record sent: topic, partition, offset.
 */
public class OutsideProducer {
    public static void main(String[] args) throws Exception {
        Map<String, KafkaProducer<String, String>> producers = new HashMap<>();
        List<Future<RecordMetadata>> sent = new ArrayList<>();
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        String line;
        while ((line = in.readLine()) != null) {
            if (line.isEmpty()) {
                continue;
            }
            String[] f = line.split("\t", 5);
            KafkaProducer<String, String> producer = producers.computeIfAbsent(f[0], codec -> {
                Properties p = new Properties();
                p.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, args[0]);
                p.put(ProducerConfig.COMPRESSION_TYPE_CONFIG, codec);
                p.put(ProducerConfig.ACKS_CONFIG, "all");
                p.put(ProducerConfig.LINGER_MS_CONFIG, "100");
                p.put(ProducerConfig.MAX_BLOCK_MS_CONFIG, "10000");
                p.put(ProducerConfig.KEY_SERIALIZER_CLASS_CONFIG, StringSerializer.class.getName());
                p.put(ProducerConfig.VALUE_SERIALIZER_CLASS_CONFIG, StringSerializer.class.getName());
                return new KafkaProducer<>(p);
            });
            ProducerRecord<String, String> record = new ProducerRecord<>(f[1], f[2], f[4]);
            record.headers().add("id", f[3].getBytes(StandardCharsets.UTF_8));
            sent.add(producer.send(record));
        }
        for (KafkaProducer<String, String> producer : producers.values()) {
            producer.flush();
        }
        for (Future<RecordMetadata> f : sent) {
            RecordMetadata m = f.get();
            System.out.println(m.topic() + "\t" + m.partition() + "\t" + m.offset());
        }
        for (KafkaProducer<String, String> producer : producers.values()) {
            producer.close();
        }
    }
}
