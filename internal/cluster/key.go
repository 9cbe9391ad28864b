package cluster

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
)

// KeySize is the size of a key LoadOrCreateKey creates (AES-256).
const KeySize = 32

// LoadOrCreateKey reads the cluster key from path, creating it if missing.
//
// Format: the key in standard base64 (with or without padding; surrounding
// whitespace such as a trailing newline is ignored) decoding to 16, 24 or
// 32 bytes — what `openssl rand -base64 32` prints and what this function
// writes; or exactly 32 raw bytes that are not base64 text.
//
// Permissions: the file must be a regular file that neither group nor
// others can access (mode 0600 or stricter); otherwise it is refused, the
// way ssh refuses a readable private key, because anyone who can read the
// key can join the cluster and inject peers, and anyone who can write it
// can cut this host off. The error says how to fix it.
//
// If path does not exist, a random 32-byte key is written there in base64
// with mode 0600 (the directory is created with mode 0700 if needed), and
// created is true. Creation is atomic: two processes racing end up with
// the same key.
func LoadOrCreateKey(path string) (key []byte, created bool, err error) {
	key, err = loadKey(path)
	if err == nil || !errors.Is(err, fs.ErrNotExist) {
		return key, false, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, false, fmt.Errorf("cluster key: %w", err)
	}
	key = make([]byte, KeySize)
	if _, err := rand.Read(key); err != nil {
		return nil, false, fmt.Errorf("cluster key: %w", err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".key-*")
	if err != nil {
		return nil, false, fmt.Errorf("cluster key: %w", err)
	}
	defer os.Remove(tmp.Name())
	text := base64.StdEncoding.EncodeToString(key) + "\n"
	if err := tmp.Chmod(0o600); err == nil {
		_, err = tmp.WriteString(text)
		if err == nil {
			err = tmp.Sync()
		}
		if cerr := tmp.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return nil, false, fmt.Errorf("cluster key: writing %s: %w", path, err)
		}
	} else {
		tmp.Close()
		return nil, false, fmt.Errorf("cluster key: %w", err)
	}
	// Link fails if another process created path meanwhile: use theirs.
	if err := os.Link(tmp.Name(), path); err != nil {
		if errors.Is(err, fs.ErrExist) {
			key, err = loadKey(path)
			return key, false, err
		}
		return nil, false, fmt.Errorf("cluster key: %w", err)
	}
	if d, err := os.Open(filepath.Dir(path)); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return key, true, nil
}

// LoadKey reads the cluster key from path, which must exist; format and
// permissions as for LoadOrCreateKey.
func LoadKey(path string) ([]byte, error) { return loadKey(path) }

func loadKey(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("cluster key: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("cluster key: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("cluster key: %s is not a regular file", path)
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("cluster key: %s has mode %04o: the key must not be accessible by group or others; "+
			"fix it with chmod 600 %s (for the managed plugin, run chmod on the host: paths under /var/lib/overlayd are its 'state' mount, "+
			"whose host directory is /var/lib/overlayd unless state.source was set; docker plugin inspect shows it)", path, perm, path)
	}
	b, err := io.ReadAll(io.LimitReader(f, 4097))
	switch {
	case err != nil:
		return nil, fmt.Errorf("cluster key: %w", err)
	case len(b) == 0:
		return nil, fmt.Errorf("cluster key: %s is empty", path)
	case len(b) > 4096:
		return nil, fmt.Errorf("cluster key: %s is too large to be a key", path)
	}
	return parseKey(b, path)
}

// parseKey accepts base64 text of 16/24/32 bytes or 32 raw bytes.
func parseKey(b []byte, path string) ([]byte, error) {
	text := bytes.TrimSpace(b)
	if len(text) > 0 {
		for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.RawStdEncoding} {
			if k, err := enc.DecodeString(string(text)); err == nil {
				switch len(k) {
				case 16, 24, 32:
					return k, nil
				}
				if len(b) != KeySize {
					return nil, fmt.Errorf("cluster key: %s holds a base64 key of %d bytes; it must be 16, 24 or 32 bytes", path, len(k))
				}
			}
		}
	}
	if len(b) == KeySize {
		return append([]byte(nil), b...), nil
	}
	return nil, fmt.Errorf("cluster key: %s holds neither base64 text of a 16, 24 or 32-byte key nor 32 raw bytes (%d bytes)", path, len(b))
}

// Fingerprint identifies a key without revealing it: the first 8 bytes of
// its SHA-256, in hex. Two hosts with the same fingerprint have the same
// key.
func Fingerprint(key []byte) string {
	if len(key) == 0 {
		return ""
	}
	sum := sha256.Sum256(key)
	return hex.EncodeToString(sum[:8])
}
