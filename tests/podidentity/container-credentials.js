// Credentials the way a Node.js service in a pod gets them: the AWS SDK for JavaScript v3's
// default chain (fromNodeProviderChain), which reaches the container provider through
// AWS_CONTAINER_CREDENTIALS_FULL_URI and AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE. Prints them
// as one JSON line; the test asks STS whose they are. NODE_PATH: tests/js/node_modules.
const { fromNodeProviderChain } = require("@aws-sdk/credential-providers");

(async () => {
  const creds = await fromNodeProviderChain()();
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
