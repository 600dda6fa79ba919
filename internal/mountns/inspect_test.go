package mountns

import "testing"

// rootUpper finds the upper layer of the overlay on "/" whatever the form of its paths
// (through an idmapped clone of the store's mount, or the store's own path), takes the
// topmost overlay on "/", and refuses a root that is no overlay of the store's layers.
func TestRootUpper(t *testing.T) {
	const idmapped = `106 89 0:45 / / rw,nodev,relatime - overlay none rw,lowerdir+=/proc/self/fd/26/images/default/rootfs,upperdir=/proc/self/fd/26/layers/17/diff,workdir=/proc/self/fd/26/layers/17/work,redirect_dir=on,uuid=on,fsync=volatile
107 106 0:42 / /dev ro,nosuid,relatime - tmpfs tmpfs ro,size=64k,mode=755
`
	const plain = `80 70 0:30 / / rw - tmpfs tmpfs rw
90 80 0:45 / / rw,nodev - overlay none rw,lowerdir=/var/lib/deltabox/layers/3/frozen:/var/lib/deltabox/images/default/rootfs,upperdir=/var/lib/deltabox/layers/42/diff,workdir=/var/lib/deltabox/layers/42/work
`
	for _, c := range []struct {
		info string
		want uint64
	}{{idmapped, 17}, {plain, 42}} {
		got, err := rootUpper([]byte(c.info))
		if err != nil || got != c.want {
			t.Errorf("rootUpper = %d, %v; want %d", got, err, c.want)
		}
	}
	for _, bad := range []string{
		"80 70 0:30 / / rw - tmpfs tmpfs rw\n",
		"90 80 0:45 / / rw - overlay none rw,lowerdir=/a:/b\n",                                // a read-only view
		"90 80 0:45 / /workspace rw - overlay none rw,upperdir=/s/layers/5/diff,workdir=/w\n", // not on /
	} {
		if got, err := rootUpper([]byte(bad)); err == nil {
			t.Errorf("rootUpper(%q) = %d, want an error", bad, got)
		}
	}
}
