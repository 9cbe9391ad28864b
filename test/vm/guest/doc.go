// Package guest holds the tests that test/vm runs inside a VM booting
// Debian's kernel, where ESP/AEAD states work. Run anywhere else (a kernel
// without ESP, or not as root) they skip.
package guest
