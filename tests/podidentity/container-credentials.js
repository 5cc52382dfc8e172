// Credentials the way a Node.js service in a pod gets them: the AWS SDK for JavaScript v3's
// default chain (fromNodeProviderChain), which reaches the container provider through
// AWS_CONTAINER_CREDENTIALS_FULL_URI and AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE. Prints the
// SDK's credentials object as JSON; the test asks STS whose they are.
// NODE_PATH: tests/js/node_modules.
const { fromNodeProviderChain } = require("@aws-sdk/credential-providers");

fromNodeProviderChain()().then(
  (creds) => process.stdout.write(JSON.stringify(creds) + "\n"),
  (err) => {
    process.stderr.write(`${err.name}: ${err.message}\n`);
    process.exit(1);
  });
