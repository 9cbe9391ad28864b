package cluster

import (
	"bytes"
	"encoding/base64"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

func TestLoadOrCreateKey(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "state", "cluster.key")
	key, created, err := LoadOrCreateKey(path)
	if err != nil || !created || len(key) != KeySize {
		t.Fatalf("create: %d bytes, created %v, %v", len(key), created, err)
	}
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v, %v", fi.Mode(), err)
	}
	if di, _ := os.Stat(filepath.Dir(path)); di.Mode().Perm() != 0o700 {
		t.Errorf("directory mode %v", di.Mode())
	}
	text, _ := os.ReadFile(path)
	if string(text) != base64.StdEncoding.EncodeToString(key)+"\n" {
		t.Errorf("file is not the base64 key: %q", text)
	}
	again, created, err := LoadOrCreateKey(path)
	if err != nil || created || !bytes.Equal(again, key) {
		t.Fatalf("reload: created %v, %v, same %v", created, err, bytes.Equal(again, key))
	}
	if entries, _ := os.ReadDir(filepath.Dir(path)); len(entries) != 1 {
		t.Errorf("temporary files left: %v", entries)
	}
}

func TestLoadOrCreateKeyConcurrent(t *testing.T) {
	path := filepath.Join(t.TempDir(), "k")
	var wg sync.WaitGroup
	keys := make([][]byte, 8)
	for i := range keys {
		wg.Go(func() {
			k, _, err := LoadOrCreateKey(path)
			if err != nil {
				t.Error(err)
			}
			keys[i] = k
		})
	}
	wg.Wait()
	for _, k := range keys[1:] {
		if !bytes.Equal(k, keys[0]) {
			t.Fatal("racing creators ended with different keys")
		}
	}
}

func TestLoadKeyFormats(t *testing.T) {
	raw := bytes.Repeat([]byte{0x80, 0x01, 0xfe, 0x7f}, 8) // 32 bytes, not base64 text
	k16 := []byte("sixteen byte key")
	for _, tc := range []struct {
		name    string
		content []byte
		mode    os.FileMode
		want    []byte
		errPart string
	}{
		{"base64 32", []byte(base64.StdEncoding.EncodeToString(testKey) + "\n"), 0o600, testKey, ""},
		{"base64 16 unpadded", []byte(base64.RawStdEncoding.EncodeToString(k16)), 0o400, k16, ""},
		{"base64 with spaces", []byte("  " + base64.StdEncoding.EncodeToString(k16) + " \n\n"), 0o600, k16, ""},
		{"raw 32", raw, 0o600, raw, ""},
		{"base64 wrong length", []byte(base64.StdEncoding.EncodeToString([]byte("twenty bytes long!!!")) + "\n"), 0o600, nil, "must be 16, 24 or 32"},
		{"raw wrong length", raw[:20], 0o600, nil, "neither"},
		{"empty", nil, 0o600, nil, "empty"},
		{"group readable", []byte(base64.StdEncoding.EncodeToString(testKey)), 0o640, nil, "chmod 600 KEYPATH (for the managed plugin, run chmod on the host: paths under /var/lib/overlayd are its 'state' mount"},
		{"world readable", []byte(base64.StdEncoding.EncodeToString(testKey)), 0o644, nil, "mode 0644"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "key")
			if err := os.WriteFile(path, tc.content, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(path, tc.mode); err != nil {
				t.Fatal(err)
			}
			key, created, err := LoadOrCreateKey(path)
			if created {
				t.Error("created over an existing file")
			}
			if tc.errPart != "" {
				want := strings.ReplaceAll(tc.errPart, "KEYPATH", path)
				if err == nil || !strings.Contains(err.Error(), want) {
					t.Fatalf("err %v, want one mentioning %q", err, want)
				}
				if strings.Contains(err.Error(), string(tc.content)) && len(tc.content) > 8 {
					t.Errorf("error reveals the key: %v", err)
				}
				return
			}
			if err != nil || !bytes.Equal(key, tc.want) {
				t.Fatalf("key %x, %v; want %x", key, err, tc.want)
			}
		})
	}
	if _, _, err := LoadOrCreateKey(t.TempDir()); err == nil {
		t.Error("a directory was accepted as a key file")
	}
}

func TestFingerprint(t *testing.T) {
	fp := Fingerprint(testKey)
	if len(fp) != 16 || fp != Fingerprint(append([]byte(nil), testKey...)) || fp == Fingerprint(k2()) {
		t.Fatalf("fingerprint %q", fp)
	}
	if strings.Contains(fp, base64.StdEncoding.EncodeToString(testKey)[:8]) {
		t.Error("fingerprint shows the key")
	}
	if Fingerprint(nil) != "" {
		t.Error("fingerprint of no key")
	}
}

func k2() []byte { k := bytes.Clone(testKey); k[0] ^= 1; return k }
