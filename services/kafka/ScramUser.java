// Creates or updates a SCRAM-SHA-512 user through Kafka's Admin API (what kafka-configs.sh
// --alter --add-config 'SCRAM-SHA-512=[...]' does), reading the password from a file so that
// it never appears in a process's arguments or in an error. Run in source-file mode:
//   java -cp <kafka classpath> ScramUser.java BOOTSTRAP USER PASSWORD_FILE
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.List;
import java.util.Map;

import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.clients.admin.ScramCredentialInfo;
import org.apache.kafka.clients.admin.ScramMechanism;
import org.apache.kafka.clients.admin.UserScramCredentialUpsertion;

public class ScramUser {
    public static void main(String[] args) throws Exception {
        String password = Files.readString(Path.of(args[2])).strip();
        try (Admin admin = Admin.create(Map.of(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, args[0]))) {
            var upsert = new UserScramCredentialUpsertion(
                args[1], new ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192), password);
            admin.alterUserScramCredentials(List.of(upsert)).all().get();
        }
    }
}
