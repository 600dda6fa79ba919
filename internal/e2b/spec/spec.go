// Package spec holds envd's protocol as E2B publishes it: process.proto and
// filesystem.proto are copied unchanged from github.com/e2b-dev/E2B, spec/envd/ (commit
// b8029973aa7da5f741f7bb1a9f833b38a0885438), and the Go code beside them is generated from them by protoc-gen-go and
// protoc-gen-connect-go (go generate ./internal/e2b/spec; protoc from Debian's
// protobuf-compiler, the generators at the versions of go.mod). Nothing here is edited by
// hand: E2B's SDKs speak exactly these messages.
package spec

//go:generate protoc -I . --go_out=. --go_opt=paths=source_relative --go_opt=Mprocess/process.proto=deltabox/internal/e2b/spec/process --go_opt=Mfilesystem/filesystem.proto=deltabox/internal/e2b/spec/filesystem --connect-go_out=. --connect-go_opt=paths=source_relative --connect-go_opt=Mprocess/process.proto=deltabox/internal/e2b/spec/process --connect-go_opt=Mfilesystem/filesystem.proto=deltabox/internal/e2b/spec/filesystem process/process.proto filesystem/filesystem.proto
