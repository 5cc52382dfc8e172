// Fetch credentials the way the AWS SDK for JavaScript v3 does on EC2, and print them as JSON.
// Used by kiamfast's end-to-end tests inside a pod network namespace.
const { fromInstanceMetadata } = require("@smithy/credential-provider-imds");

(async () => {
  const provider = fromInstanceMetadata({ timeout: 1000, maxRetries: 0 });
  const creds = await provider();
  process.stdout.write(JSON.stringify({
    AccessKeyId: creds.accessKeyId,
    SecretAccessKey: creds.secretAccessKey,
    Token: creds.sessionToken,
    Expiration: creds.expiration && creds.expiration.toISOString(),
  }) + "\n");
})().catch((err) => {
  process.stderr.write(`${err.name}: ${err.message}\n`);
  process.exit(1);
});
