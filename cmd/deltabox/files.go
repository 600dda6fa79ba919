package main

import (
	"fmt"
	"io"
	"os"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"deltabox/internal/apitypes"
	"deltabox/internal/client"
)

func filesCmd() *cobra.Command {
	c := &cobra.Command{
		Use:   "files",
		Short: "Read, write, list and remove files in a sandbox (paths are absolute or relative to its workdir)",
	}
	c.AddCommand(filesReadCmd(), filesWriteCmd(), filesLsCmd(), filesStatCmd(), filesRmCmd(), filesMkdirCmd())
	return c
}

// parseMode parses an octal mode flag ("" or "0": none).
func filesParseMode(s string) (os.FileMode, error) {
	if s == "" {
		return 0, nil
	}
	n, err := strconv.ParseUint(s, 8, 32)
	if err != nil || n > 0o7777 {
		return 0, fmt.Errorf("--mode %q: want octal permission bits such as 0644", s)
	}
	m := os.FileMode(n & 0o777)
	if n&0o4000 != 0 {
		m |= os.ModeSetuid
	}
	if n&0o2000 != 0 {
		m |= os.ModeSetgid
	}
	if n&0o1000 != 0 {
		m |= os.ModeSticky
	}
	return m, nil
}

func filesReadCmd() *cobra.Command {
	var offset, length int64
	c := &cobra.Command{
		Use:   "read SANDBOX PATH [--offset N] [--length N]",
		Short: "Print a file's content (up to 64 MiB per read; use --offset/--length beyond)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			rc, _, err := cli().OpenFile(ctx(), args[0], args[1], offset, length)
			if err != nil {
				return err
			}
			defer rc.Close()
			_, err = io.Copy(os.Stdout, rc)
			return err
		},
	}
	c.Flags().Int64Var(&offset, "offset", 0, "start at this byte")
	c.Flags().Int64Var(&length, "length", 0, "read at most this many bytes (0: to the end)")
	return c
}

func filesWriteCmd() *cobra.Command {
	var from, mode string
	var mkdir bool
	c := &cobra.Command{
		Use:   "write SANDBOX PATH [--from FILE] [--mode 0644] [-p]",
		Short: "Replace a file's content atomically with stdin (or --from FILE)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			m, err := filesParseMode(mode)
			if err != nil {
				return err
			}
			var in io.Reader = os.Stdin
			if from != "" {
				f, err := os.Open(from)
				if err != nil {
					return err
				}
				defer f.Close()
				in = f
			}
			info, err := cli().WriteFile(ctx(), args[0], args[1], in, client.WriteFileOptions{Mode: m, Mkdir: mkdir})
			if err != nil {
				return err
			}
			if jsonOut {
				printJSON(info)
			}
			return nil
		},
	}
	c.Flags().StringVar(&from, "from", "", "read the content from this local file instead of stdin")
	c.Flags().StringVar(&mode, "mode", "", "permission bits, octal (default: keep an existing file's, 0644 for a new one)")
	c.Flags().BoolVarP(&mkdir, "mkdir", "p", false, "create missing parent directories")
	return c
}

func filesPrintInfo(e *apitypes.FileInfo) {
	line := fmt.Sprintf("%s %5d %5d %10d %s %s", e.Permissions, e.UID, e.GID, e.Size, e.ModTime.Local().Format(time.DateTime), e.Path)
	if e.LinkTarget != "" {
		line += " -> " + e.LinkTarget
	}
	if e.MountPoint {
		line += "  (another mount: not reachable)"
	}
	fmt.Println(line)
}

func filesLsCmd() *cobra.Command {
	var o client.ListFilesOptions
	c := &cobra.Command{
		Use:   "ls SANDBOX [PATH] [-r] [--depth N] [--max-entries N]",
		Short: "List a directory (default: the workdir)",
		Args:  cobra.RangeArgs(1, 2),
		RunE: func(cmd *cobra.Command, args []string) error {
			p := ""
			if len(args) == 2 {
				p = args[1]
			}
			l, err := cli().ListFiles(ctx(), args[0], p, o)
			if err != nil {
				return err
			}
			if jsonOut {
				printJSON(l)
				return nil
			}
			for i := range l.Entries {
				filesPrintInfo(&l.Entries[i])
			}
			if l.Truncated {
				fmt.Fprintf(os.Stderr, "deltabox: listing truncated at %d entries (--max-entries)\n", len(l.Entries))
			}
			return nil
		},
	}
	c.Flags().BoolVarP(&o.Recursive, "recursive", "r", false, "list subdirectories too")
	c.Flags().IntVar(&o.Depth, "depth", 0, "levels of a recursive listing (default 32)")
	c.Flags().IntVar(&o.MaxEntries, "max-entries", 0, "stop after this many entries (default 10000)")
	return c
}

func filesStatCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "stat SANDBOX PATH",
		Short: "Describe a file (a symlink itself, not its target)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			in, err := cli().StatFile(ctx(), args[0], args[1])
			if err != nil {
				return err
			}
			if jsonOut {
				printJSON(in)
			} else {
				filesPrintInfo(in)
			}
			return nil
		},
	}
}

func filesRmCmd() *cobra.Command {
	var recursive bool
	c := &cobra.Command{
		Use:   "rm SANDBOX PATH [-r]",
		Short: "Remove a file, a symlink or an empty directory (-r: a whole directory)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			return cli().RemoveFile(ctx(), args[0], args[1], recursive)
		},
	}
	c.Flags().BoolVarP(&recursive, "recursive", "r", false, "remove a directory and everything in it")
	return c
}

func filesMkdirCmd() *cobra.Command {
	var mode string
	c := &cobra.Command{
		Use:   "mkdir SANDBOX PATH [--mode 0755]",
		Short: "Create a directory and its missing parents",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			m, err := filesParseMode(mode)
			if err != nil {
				return err
			}
			r, err := cli().Mkdir(ctx(), args[0], args[1], m)
			if err != nil {
				return err
			}
			if jsonOut {
				printJSON(r)
			}
			return nil
		},
	}
	c.Flags().StringVar(&mode, "mode", "", "permission bits, octal (default 0755)")
	return c
}
