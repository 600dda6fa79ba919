// Package pydriver holds the Python both python drivers run: the python session's
// (internal/session, over a terminal) and the latency bench's baseline process
// (internal/bench, over a unix socket). Both must run a call's code exactly as the
// session does, or the baselines would measure another interpreter's behaviour.
package pydriver

// Exec is Python source (top level, for a driver's -c program) defining g, the globals
// that every call of one process shares, and run(src), which runs src as a module body in
// g under the file name "<session>" (tracebacks are cut at it) and returns the repr of
// its last expression statement, as the interactive interpreter shows it (None: it has
// none, or its value is None). It needs ast imported.
const Exec = `
g = {"__name__": "__main__", "__builtins__": __builtins__}
def run(src):
    tree = ast.parse(src, "<session>", "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<session>", "exec"), g)
    if last is not None:
        v = eval(compile(last, "<session>", "eval"), g)
        if v is not None:
            return repr(v)
    return None
`
