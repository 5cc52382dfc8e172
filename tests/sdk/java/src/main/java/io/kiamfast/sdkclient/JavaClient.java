package io.kiamfast.sdkclient;

import java.net.URI;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;

import software.amazon.awssdk.auth.credentials.AwsCredentials;
import software.amazon.awssdk.auth.credentials.AwsCredentialsProvider;
import software.amazon.awssdk.auth.credentials.AwsSessionCredentials;
import software.amazon.awssdk.auth.credentials.DefaultCredentialsProvider;
import software.amazon.awssdk.auth.credentials.InstanceProfileCredentialsProvider;
import software.amazon.awssdk.http.urlconnection.UrlConnectionHttpClient;
import software.amazon.awssdk.regions.Region;
import software.amazon.awssdk.services.sts.StsClient;
import software.amazon.awssdk.services.sts.StsClientBuilder;
import software.amazon.awssdk.services.sts.model.GetCallerIdentityResponse;

/**
 * Gets credentials the way a Java service on EC2 does, with the AWS SDK for Java v2, and asks
 * STS whose they are.
 *
 * <p>kiamfast's end-to-end tests run it inside a pod's network namespace with no AWS
 * credentials in its environment, so the SDK ends at the instance metadata service
 * (169.254.169.254, sent to the agent by the node's DNAT rule). Providers:
 * {@code --provider instance-profile} is {@code InstanceProfileCredentialsProvider.create()}
 * (with {@code --stale-time S} the builder's staleTime, so a test can make the SDK refetch
 * without waiting for the real expiry); {@code --provider default} is
 * {@code DefaultCredentialsProvider.create()}, the whole default chain. Both honour
 * {@code AWS_EC2_METADATA_V1_DISABLED} and {@code AWS_METADATA_SERVICE_TIMEOUT} as the SDK does.
 *
 * <p>Each round resolves credentials (the provider caches them until they are stale) and calls
 * STS GetCallerIdentity with them, against {@code AWS_ENDPOINT_URL_STS} in {@code AWS_REGION}.
 * {@code --loop N --interval S} runs N rounds S seconds apart. Output: one JSON line with the
 * last round's fields at the top level and every round in {@code rounds}. Exit 0 when every
 * round got credentials that STS accepted, 3 when no round got any, 1 otherwise.
 */
public final class JavaClient {
    private JavaClient() {
    }

    public static void main(String[] args) throws InterruptedException {
        Map<String, String> opts = parseArgs(args);
        int loop = Integer.parseInt(opts.getOrDefault("loop", "1"));
        long intervalMillis = (long) (Double.parseDouble(opts.getOrDefault("interval", "1")) * 1000);
        AwsCredentialsProvider provider = provider(opts);
        List<Map<String, Object>> rounds = new ArrayList<>();
        try (StsClient sts = stsClient(provider)) {
            for (int i = 0; i < loop; i++) {
                if (i > 0) {
                    Thread.sleep(intervalMillis);
                }
                rounds.add(once(provider, sts));
            }
        }
        Map<String, Object> out = new HashMap<>(rounds.get(rounds.size() - 1));
        out.put("rounds", rounds);
        System.out.println(Json.write(out));
        System.exit(exitCode(rounds));
    }

    static AwsCredentialsProvider provider(Map<String, String> opts) {
        String name = opts.getOrDefault("provider", "instance-profile");
        switch (name) {
            case "instance-profile":
                if (!opts.containsKey("stale-time")) {
                    return InstanceProfileCredentialsProvider.create();
                }
                double staleSeconds = Double.parseDouble(opts.get("stale-time"));
                return InstanceProfileCredentialsProvider.builder()
                        .staleTime(Duration.ofMillis((long) (staleSeconds * 1000)))
                        .build();
            case "default":
                return DefaultCredentialsProvider.create();
            default:
                throw new IllegalArgumentException("unknown --provider " + name);
        }
    }

    /** STS with the pod's credentials, at the endpoint and region the environment names. */
    static StsClient stsClient(AwsCredentialsProvider provider) {
        StsClientBuilder builder = StsClient.builder()
                .credentialsProvider(provider)
                .httpClient(UrlConnectionHttpClient.create())
                .region(Region.of(System.getenv().getOrDefault("AWS_REGION", "us-east-1")));
        String endpoint = System.getenv("AWS_ENDPOINT_URL_STS");
        if (endpoint != null && !endpoint.isEmpty()) {
            builder.endpointOverride(URI.create(endpoint));
        }
        return builder.build();
    }

    /** One round: credentials from the provider, then GetCallerIdentity signed with them. */
    static Map<String, Object> once(AwsCredentialsProvider provider, StsClient sts) {
        Map<String, Object> r = new HashMap<>();
        r.put("at", Instant.now().toString());
        long started = System.nanoTime();
        AwsCredentials creds;
        try {
            creds = provider.resolveCredentials();
        } catch (RuntimeException e) {
            r.put("seconds", (System.nanoTime() - started) / 1e9);
            r.put("error", describe(e));
            return r;
        }
        r.put("seconds", (System.nanoTime() - started) / 1e9);
        r.put("AccessKeyId", creds.accessKeyId());
        creds.providerName().ifPresent(p -> r.put("ProviderName", p));
        creds.accountId().ifPresent(a -> r.put("AccountId", a));
        if (creds instanceof AwsSessionCredentials) {
            ((AwsSessionCredentials) creds).expirationTime()
                    .ifPresent(t -> r.put("Expiration", t.toString()));
        }
        try {
            GetCallerIdentityResponse ident = sts.getCallerIdentity();
            r.put("Arn", ident.arn());
            r.put("Account", ident.account());
        } catch (RuntimeException e) {
            r.put("sts_error", describe(e));
        }
        return r;
    }

    static int exitCode(List<Map<String, Object>> rounds) {
        boolean gotAny = false;
        boolean allGood = true;
        for (Map<String, Object> r : rounds) {
            gotAny |= r.containsKey("AccessKeyId");
            allGood &= !r.containsKey("error") && !r.containsKey("sts_error");
        }
        return allGood ? 0 : gotAny ? 1 : 3;
    }

    static String describe(Throwable e) {
        StringBuilder text = new StringBuilder();
        for (Throwable t = e; t != null; t = t.getCause()) {
            if (text.length() > 0) {
                text.append(" <- ");
            }
            text.append(t.getClass().getSimpleName()).append(": ").append(t.getMessage());
        }
        return text.toString();
    }

    /** --name value pairs. */
    static Map<String, String> parseArgs(String[] args) {
        Map<String, String> opts = new HashMap<>();
        for (int i = 0; i < args.length; i++) {
            if (!args[i].startsWith("--") || i + 1 >= args.length) {
                throw new IllegalArgumentException("expected --name value, got " + args[i]);
            }
            opts.put(args[i].substring(2), args[++i]);
        }
        return opts;
    }

    /** Just enough JSON writing for strings, numbers, lists and maps (no extra dependency). */
    static final class Json {
        private Json() {
        }

        static String write(Object value) {
            StringBuilder out = new StringBuilder();
            append(out, value);
            return out.toString();
        }

        private static void append(StringBuilder out, Object value) {
            if (value == null) {
                out.append("null");
            } else if (value instanceof Number || value instanceof Boolean) {
                out.append(value);
            } else if (value instanceof Map) {
                out.append('{');
                boolean first = true;
                for (Map.Entry<?, ?> e : ((Map<?, ?>) value).entrySet()) {
                    out.append(first ? "" : ",");
                    first = false;
                    append(out, String.valueOf(e.getKey()));
                    out.append(':');
                    append(out, e.getValue());
                }
                out.append('}');
            } else if (value instanceof List) {
                out.append('[');
                boolean first = true;
                for (Object item : (List<?>) value) {
                    out.append(first ? "" : ",");
                    first = false;
                    append(out, item);
                }
                out.append(']');
            } else {
                out.append('"');
                for (char c : value.toString().toCharArray()) {
                    if (c == '"' || c == '\\') {
                        out.append('\\').append(c);
                    } else if (c < 0x20) {
                        out.append(String.format("\\u%04x", (int) c));
                    } else {
                        out.append(c);
                    }
                }
                out.append('"');
            }
        }
    }
}
