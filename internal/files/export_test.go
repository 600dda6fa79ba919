package files

import "io"

// For the external tests: code that only tests use lives here, not in the daemon.

// Read returns length bytes (0: to the end) of regular file p from off, refusing more
// than max bytes (0: DefaultMaxRead), and the file's Info.
func Read(root int, p string, off, length, max int64) ([]byte, *Info, error) {
	f, in, err := Open(root, p)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	n, err := ReadRange(in.Path, in.Size, off, length, max)
	if err != nil {
		return nil, nil, err
	}
	b := make([]byte, n)
	m, err := f.ReadAt(b, off)
	if err != nil && err != io.EOF {
		return nil, nil, fsErr(in.Path, err)
	}
	return b[:m], in, nil
}
