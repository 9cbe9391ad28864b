package statefile

import bolt "go.etcd.io/bbolt"

type txAlias = bolt.Tx
