package docker

import (
	"archive/tar"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"time"
)

const image = "ovdt-busybox:latest"

// writeBusyboxRootfs writes a tar of a minimal rootfs made from the host's
// static busybox: /bin/busybox, a symlink per applet, and the usual empty
// directories. Engines import it with `docker import` (there is no registry).
func writeBusyboxRootfs(path string) error {
	list, err := exec.Command(busyboxBinary, "--list").Output()
	if err != nil {
		return fmt.Errorf("%s --list: %w", busyboxBinary, err)
	}
	bin, err := os.ReadFile(busyboxBinary)
	if err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	now := time.Now()
	add := func(h *tar.Header, body []byte) error {
		h.ModTime = now
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		_, err := tw.Write(body)
		return err
	}
	for _, d := range []struct {
		name string
		mode int64
	}{{"bin", 0o755}, {"dev", 0o755}, {"etc", 0o755}, {"proc", 0o555}, {"root", 0o700}, {"sys", 0o555}, {"tmp", 0o1777}, {"var", 0o755}} {
		if err := add(&tar.Header{Typeflag: tar.TypeDir, Name: d.name + "/", Mode: d.mode}, nil); err != nil {
			return err
		}
	}
	if err := add(&tar.Header{Typeflag: tar.TypeReg, Name: "bin/busybox", Mode: 0o755, Size: int64(len(bin))}, bin); err != nil {
		return err
	}
	for _, applet := range strings.Fields(string(list)) {
		if applet == "busybox" || strings.Contains(applet, "/") {
			continue
		}
		if err := add(&tar.Header{Typeflag: tar.TypeSymlink, Name: "bin/" + applet, Linkname: "busybox", Mode: 0o777}, nil); err != nil {
			return err
		}
	}
	for name, body := range map[string]string{
		"etc/passwd": "root:x:0:0:root:/root:/bin/sh\n",
		"etc/group":  "root:x:0:\n",
	} {
		if err := add(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: int64(len(body))}, []byte(body)); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return f.Close()
}
