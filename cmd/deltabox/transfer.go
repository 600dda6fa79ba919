package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
)

func exportCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "export NODE FILE",
		Short: "Write a node, its layer chain and its process image to FILE (- for stdout), to import on another host",
		Long: `Write a node to one self-contained archive: the layers of its chain (each a blob named
by its sha256), its metadata and its durable process image. The image the chain sits on
does not travel: the importing host must have an image of the same name.

FILE is written next to itself and renamed when complete: a cut export leaves no FILE.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			node, file := args[0], args[1]
			var w io.Writer = os.Stdout
			var tmp *os.File
			if file != "-" {
				var err error
				tmp, err = os.CreateTemp(filepath.Dir(file), "."+filepath.Base(file)+".part-*")
				if err != nil {
					return err
				}
				defer func() {
					tmp.Close()
					os.Remove(tmp.Name())
				}()
				w = tmp
			}
			warnings, err := cli().ExportNode(ctx(), node, w)
			if err != nil {
				return err
			}
			for _, wn := range warnings {
				fmt.Fprintln(os.Stderr, "warning:", wn)
			}
			if tmp == nil {
				return nil
			}
			if err := tmp.Sync(); err != nil {
				return err
			}
			if err := os.Rename(tmp.Name(), file); err != nil {
				return err
			}
			fi, _ := os.Stat(file)
			if fi != nil {
				fmt.Fprintf(os.Stderr, "exported %s to %s (%d bytes)\n", node, file, fi.Size())
			}
			return nil
		},
	}
}

func importCmd() *cobra.Command {
	var maxBytes, maxEntries int64
	c := &cobra.Command{
		Use:   "import FILE",
		Short: "Import a node archive (deltabox export) into this host's tree; prints the new node's id last",
		Long: `Import a node archive. Every byte is verified against its digest before anything is
kept; a damaged, truncated or hostile archive is refused and leaves nothing behind.
Nodes this host already has (same image and layers) are reused, not written again.

The node's processes do not come back on this host: a durable process image restores
only into the sandbox that made it. Restoring (or creating a sandbox on) the imported
node gives its files; its sessions start afresh.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var r io.Reader = os.Stdin
			if args[0] != "-" {
				f, err := os.Open(args[0])
				if err != nil {
					return err
				}
				defer f.Close()
				r = f
			}
			res, err := cli().ImportNode(ctx(), r, maxBytes, maxEntries)
			if err != nil {
				return err
			}
			if jsonOut {
				printJSON(res)
				return nil
			}
			for _, w := range res.Warnings {
				fmt.Fprintln(os.Stderr, "warning:", w)
			}
			for _, n := range res.Nodes {
				switch {
				case n.Reused && n.ID != "":
					fmt.Printf("%s -> %s (already here)\n", n.From, n.ID)
				case !n.Reused:
					fmt.Printf("%s -> %s\n", n.From, n.ID)
				}
			}
			fmt.Println(res.Node)
			return nil
		},
	}
	c.Flags().Int64Var(&maxBytes, "max-bytes", 0, "cap on the layer data written (0: 4 GiB)")
	c.Flags().Int64Var(&maxEntries, "max-entries", 0, "cap on the entries (0: 4194304)")
	return c
}
