// Command kiamfast-go-client gets credentials the way a Go service on EC2 does, with the
// AWS SDK for Go v2, and asks STS whose they are.
//
// kiamfast's end-to-end tests run it inside a pod's network namespace with no AWS
// credentials in its environment, so the SDK's credential chain ends at the instance
// metadata service (169.254.169.254, sent to the agent by the node's DNAT rule). Two
// providers:
//
//	--provider default       config.LoadDefaultConfig: the SDK's whole default chain
//	                         (environment, shared files, web identity, containers, then the
//	                         IMDS role provider), honouring AWS_EC2_METADATA_V1_DISABLED
//	--provider ec2rolecreds  ec2rolecreds.New() in an aws.CredentialsCache, as services
//	                         that pin the instance role do
//
// Each round retrieves credentials through the SDK's credential cache and then calls STS
// GetCallerIdentity with them (the endpoint comes from AWS_ENDPOINT_URL_STS, the region
// from AWS_REGION, as the SDK itself resolves them). --loop N --interval D runs N rounds.
// The cache refreshes only once its credentials expire; --expiry-window W moves that moment
// W before the Expiration the metadata service sent (the SDK's own ExpiryWindow option), so
// a test can watch the SDK refetch without waiting an hour.
//
// --print-rounds also prints each round as it ends, as {"round": {...}} on a line of its own,
// so a long-running client (an app container a test deletes) shows what it got so far.
//
// Output: one JSON line. The last round's fields at the top level (AccessKeyId, Expires,
// CanExpire, Source, Arn, Account, error, sts_error, seconds) and every round in "rounds".
// Exit 0 when every round got credentials that STS accepted, 3 when no round got any
// credentials, 1 otherwise.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/credentials/ec2rolecreds"
	"github.com/aws/aws-sdk-go-v2/service/sts"
)

type round struct {
	At          string  `json:"at"`
	AccessKeyID string  `json:"AccessKeyId,omitempty"`
	Expires     string  `json:"Expires,omitempty"`
	CanExpire   bool    `json:"CanExpire"`
	Source      string  `json:"Source,omitempty"`
	Seconds     float64 `json:"seconds"` // how long the SDK took to hand out credentials
	Arn         string  `json:"Arn,omitempty"`
	Account     string  `json:"Account,omitempty"`
	Error       string  `json:"error,omitempty"`
	StsError    string  `json:"sts_error,omitempty"`
}

func main() {
	provider := flag.String("provider", "default", "default or ec2rolecreds")
	loop := flag.Int("loop", 1, "rounds of retrieve + GetCallerIdentity")
	interval := flag.Duration("interval", time.Second, "pause between rounds")
	window := flag.Duration("expiry-window", 0, "the credential cache's ExpiryWindow")
	printRounds := flag.Bool("print-rounds", false, "also print each round as it ends")
	flag.Parse()

	ctx := context.Background()
	cfg, err := loadConfig(ctx, *provider, *window)
	if err != nil {
		emit(round{Error: "config: " + err.Error()}, nil)
		os.Exit(1)
	}
	client := sts.NewFromConfig(cfg)

	rounds := make([]round, 0, *loop)
	for i := 0; i < *loop; i++ {
		if i > 0 {
			time.Sleep(*interval)
		}
		r := once(ctx, cfg.Credentials, client)
		rounds = append(rounds, r)
		if *printRounds {
			line, _ := json.Marshal(map[string]round{"round": r})
			fmt.Println(string(line))
		}
	}
	emit(rounds[len(rounds)-1], rounds)
	os.Exit(exitCode(rounds))
}

// loadConfig builds the SDK configuration a Go service would have on EC2, with the chosen
// credential provider behind the SDK's credential cache.
func loadConfig(ctx context.Context, provider string, window time.Duration) (aws.Config, error) {
	cacheOptions := func(o *aws.CredentialsCacheOptions) { o.ExpiryWindow = window }
	switch provider {
	case "default":
		return config.LoadDefaultConfig(ctx, config.WithCredentialsCacheOptions(cacheOptions))
	case "ec2rolecreds":
		cache := aws.NewCredentialsCache(ec2rolecreds.New(), cacheOptions)
		return config.LoadDefaultConfig(ctx, config.WithCredentialsProvider(cache))
	}
	return aws.Config{}, fmt.Errorf("unknown --provider %q", provider)
}

// once is one round: credentials from the cache (which asks the metadata service when they
// are missing or expired), then GetCallerIdentity signed with them.
func once(ctx context.Context, creds aws.CredentialsProvider, client *sts.Client) round {
	r := round{At: time.Now().UTC().Format(time.RFC3339Nano)}
	started := time.Now()
	got, err := creds.Retrieve(ctx)
	r.Seconds = time.Since(started).Seconds()
	if err != nil {
		r.Error = err.Error()
		return r
	}
	r.AccessKeyID, r.CanExpire, r.Source = got.AccessKeyID, got.CanExpire, got.Source
	if got.CanExpire {
		r.Expires = got.Expires.UTC().Format(time.RFC3339)
	}
	ident, err := client.GetCallerIdentity(ctx, &sts.GetCallerIdentityInput{})
	if err != nil {
		r.StsError = err.Error()
		return r
	}
	r.Arn, r.Account = aws.ToString(ident.Arn), aws.ToString(ident.Account)
	return r
}

func emit(last round, rounds []round) {
	out := map[string]any{}
	raw, _ := json.Marshal(last)
	_ = json.Unmarshal(raw, &out)
	if rounds != nil {
		out["rounds"] = rounds
	}
	line, _ := json.Marshal(out)
	fmt.Println(string(line))
}

func exitCode(rounds []round) int {
	gotAny, allGood := false, true
	for _, r := range rounds {
		if r.AccessKeyID != "" {
			gotAny = true
		}
		if r.Error != "" || r.StsError != "" {
			allGood = false
		}
	}
	switch {
	case allGood:
		return 0
	case !gotAny:
		return 3
	}
	return 1
}
