// Package transfer is the archive a node travels in between hosts (deltabox export and
// import; internal/state/transfer.go drives it; docs/design/transfer.md has the why).
//
//	manifest.json      Manifest: format and version, the image's name and size, the
//	                   chain (root's side first) with each node's own layer as a Blob
//	blobs/sha256/HEX   a tree (a layer, the process image) as WriteTree wrote it; HEX
//	                   is the sha256 of those bytes
//	manifest.sha256    the manifest's digest, last: a truncated archive has none
//
// The contract:
//
//	WriteTree(w, dir)  a tree as a tar that depends only on the tree (sorted, numeric
//	                   owners, no atime/ctime, holes left out), so its digest names its
//	                   content; Digest hashes it without keeping it
//	Writer             the archive: Manifest, then Tree per blob (checked against the
//	                   digest it was announced with), then Close (the trailer)
//	Reader             Manifest, then Next per blob: each blob's bytes are hashed as the
//	                   caller reads them and compared with its name when it ends; at the
//	                   trailer, io.EOF once the manifest's digest and every blob are
//	                   confirmed. Nothing the caller built is to be kept before that.
//	ExtractTree(r, dir) a tree into an empty directory, confined to it (openat2
//	                   RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV from
//	                   dir for every parent, O_EXCL | O_NOFOLLOW for every entry),
//	                   refusing what a layer does not hold (see its doc)
//
// Errors: ErrRefused for an archive refused for what it holds (damaged, truncated,
// hostile), ErrIncompatible for another version; the caller maps both to a 400.
package transfer
