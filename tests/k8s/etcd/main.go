// Command etcd is the real etcd server for tests/k8s, built from the Go module proxy:
// etcdmain.Main is what etcd's own binary runs, so every etcd flag works as documented.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
