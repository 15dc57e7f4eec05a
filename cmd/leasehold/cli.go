package main

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"regexp"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// Every command's flags follow the same rules, kept here: a flag may read
// environment variables (the first one set to a non-empty value applies when
// the flag is not given, so a flag overrides its variable, and an empty
// variable counts as unset), an old spelling may stay as a hidden alias that
// prints a deprecation note, and errors name the flag — and the variable
// when the value came from one.

const (
	annotationEnv     = "leasehold/env"     // variables a flag reads, in order
	annotationFromEnv = "leasehold/fromenv" // the variable its value came from
)

// bindEnv makes flag name read vars (the first one set and not empty, when
// the flag is not given) and says so in its help.
func bindEnv(fs *pflag.FlagSet, name string, vars ...string) {
	f := fs.Lookup(name)
	if f == nil {
		panic("bindEnv: no flag --" + name)
	}
	refs := make([]string, len(vars))
	for i, v := range vars {
		refs[i] = "$" + v
	}
	f.Usage += " [" + strings.Join(refs, ", ") + "]"
	if err := fs.SetAnnotation(name, annotationEnv, vars); err != nil {
		panic(err)
	}
}

// envOf is the variables flag f reads.
func envOf(f *pflag.Flag) []string { return f.Annotations[annotationEnv] }

// applyEnv sets every flag not given on the command line from the first of
// its variables that is set to a non-empty value; a bad value is refused
// naming both. An empty variable counts as unset: systemd units
// (Environment=LEASEHOLD_X=) and templates that fill in nothing produce
// empty variables all the time, and taken as a value "" would refuse most
// flags or, worse, mean something other than the default.
func applyEnv(fs *pflag.FlagSet) error {
	var errs []string
	fs.VisitAll(func(f *pflag.Flag) {
		if f.Changed {
			return
		}
		for _, v := range envOf(f) {
			val := os.Getenv(v)
			if val == "" {
				continue // unset, or set to nothing: the same
			}
			if err := f.Value.Set(val); err != nil {
				errs = append(errs,
					fmt.Sprintf("invalid --%s (from $%s) %q: %v", f.Name, v, val, err))
			}
			f.Changed = true
			if f.Annotations == nil {
				f.Annotations = map[string][]string{}
			}
			f.Annotations[annotationFromEnv] = []string{v}
			return
		}
	})
	if len(errs) > 0 {
		return errors.New(strings.Join(errs, "\n"))
	}
	return nil
}

// flagRef names flag name for an error: "--name", or "--name (from $VAR)"
// when its value came from the environment.
func flagRef(fs *pflag.FlagSet, name string) string {
	if f := fs.Lookup(name); f != nil {
		if v := f.Annotations[annotationFromEnv]; len(v) == 1 {
			return "--" + name + " (from $" + v[0] + ")"
		}
	}
	return "--" + name
}

// fromEnv maps each flag of fs whose value came from a variable to that
// variable, for errors found after parsing (a busy --xds-addr, a missing
// --rules file) to name it too.
func fromEnv(fs *pflag.FlagSet) map[string]string {
	m := map[string]string{}
	fs.VisitAll(func(f *pflag.Flag) {
		if v := f.Annotations[annotationFromEnv]; len(v) == 1 {
			m[f.Name] = v[0]
		}
	})
	return m
}

// flagWord finds a flag's name in a message (--tls-cert, not the tail of
// --admin-tls-cert or the start of --tls-certs).
var flagWord = regexp.MustCompile(`(^|[^a-z0-9-])--([a-z0-9][a-z0-9-]*)`)

// withVariables names, after each flag in msg whose value came from a
// variable, that variable: "--rules" becomes "--rules (from $LEASEHOLD_RULES)",
// unless msg says so already.
func withVariables(msg string, vars map[string]string) string {
	if len(vars) == 0 {
		return msg
	}
	var b strings.Builder
	last := 0
	for _, m := range flagWord.FindAllStringSubmatchIndex(msg, -1) {
		end := m[1]
		v, ok := vars[msg[m[4]:m[5]]]
		if !ok || strings.HasPrefix(msg[end:], " (from $") {
			continue
		}
		b.WriteString(msg[last:end])
		b.WriteString(" (from $" + v + ")")
		last = end
	}
	b.WriteString(msg[last:])
	return b.String()
}

// parseLogLevel reads a --log-level: debug, info, warn or error (and slog's
// offsets from them, such as info+2).
func parseLogLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return 0, errors.New("not a level: want debug, info, warn or error")
	}
	return l, nil
}

// alias adds old as a hidden, deprecated spelling of flag name: it sets the
// same value, and using it prints a note (applyAliases).
func alias(fs *pflag.FlagSet, old, name string) {
	f := fs.Lookup(name)
	if f == nil {
		panic("alias: no flag --" + name)
	}
	fs.AddFlag(&pflag.Flag{Name: old, Usage: "deprecated: use --" + name, Value: f.Value,
		DefValue: f.DefValue, NoOptDefVal: f.NoOptDefVal, Hidden: true,
		Annotations: map[string][]string{"leasehold/alias": {name}}})
}

// applyAliases marks a flag given under an old spelling as given, refuses
// both spellings at once, and writes a deprecation note for each old one.
func applyAliases(fs *pflag.FlagSet, notes io.Writer) error {
	var errs []string
	fs.VisitAll(func(f *pflag.Flag) {
		if why := f.Annotations["leasehold/ignored"]; len(why) == 1 && f.Changed {
			fmt.Fprintf(notes, "note: --%s ignored: %s\n", f.Name, why[0])
			return
		}
		to := f.Annotations["leasehold/alias"]
		if len(to) != 1 || !f.Changed {
			return
		}
		nf := fs.Lookup(to[0])
		if nf.Changed {
			errs = append(errs, fmt.Sprintf("--%s and --%s are the same flag: give --%s only",
				f.Name, nf.Name, nf.Name))
			return
		}
		nf.Changed = true // the value is shared, so no variable may override it
		fmt.Fprintf(notes, "note: --%s is deprecated and will be removed: use --%s\n",
			f.Name, nf.Name)
	})
	if len(errs) > 0 {
		return errors.New(strings.Join(errs, "\n"))
	}
	return nil
}

// ignoredFlag accepts flag name, hidden, for old command lines, and says
// why it is not needed.
func ignoredFlag(fs *pflag.FlagSet, name, why string) {
	fs.String(name, "", why)
	fs.Lookup(name).Hidden = true
	fs.SetAnnotation(name, "leasehold/ignored", []string{why})
}

// finishFlags refuses empty values given on the command line, then applies
// aliases, then the environment, to a parsed flag set.
func finishFlags(fs *pflag.FlagSet, notes io.Writer) error {
	if err := refuseEmpty(fs); err != nil {
		return err
	}
	if err := applyAliases(fs, notes); err != nil {
		return err
	}
	return applyEnv(fs)
}

// annotationEmptyOK marks a flag whose empty value means something (e.g.
// "off" or "none"), so --flag= is not a mistake.
const annotationEmptyOK = "leasehold/empty-ok"

// emptyOK lets flag name be given with an empty value.
func emptyOK(fs *pflag.FlagSet, name string) {
	if err := fs.SetAnnotation(name, annotationEmptyOK, []string{"true"}); err != nil {
		panic(err)
	}
}

// refuseEmpty refuses a flag given on the command line with an empty value
// (--instance "$INST" with INST unset, --flag=). Read as the flag's default,
// such a value would do something other than asked (a cordon of a whole task
// type, a bootstrap without its constraint, a serve without its policy). It
// runs before the environment applies, because an empty variable is not a
// flag given.
func refuseEmpty(fs *pflag.FlagSet) error {
	var errs []string
	fs.VisitAll(func(f *pflag.Flag) {
		if !f.Changed || f.Value.String() != "" || len(f.Annotations[annotationEmptyOK]) > 0 ||
			len(f.Annotations["leasehold/ignored"]) > 0 {
			return
		}
		if len(f.Annotations[annotationFromEnv]) > 0 {
			return // set from a variable earlier (finishFlags runs once; defensive)
		}
		errs = append(errs, fmt.Sprintf(
			"invalid --%s: given with an empty value (leave it out for its default)", f.Name))
	})
	if len(errs) > 0 {
		return errors.New(strings.Join(errs, "\n"))
	}
	return nil
}

// exitError ends a command with a code: 1 for failures at run time, 2 for
// usage errors. Errors of any other type are usage errors.
type exitError struct {
	code  int
	err   error
	quiet bool // the reason is already told (logged), so nothing more is printed
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// failed is a runtime failure (exit 1).
func failed(err error) error { return &exitError{code: 1, err: err} }

// quiet ends a command with code, its reason already told.
func quiet(code int) error {
	return &exitError{code: code, err: fmt.Errorf("exit status %d", code), quiet: true}
}

// failedf is a runtime failure (exit 1) with a formatted message.
func failedf(format string, a ...any) error { return failed(fmt.Errorf(format, a...)) }

// usagef is a usage error (exit 2).
func usagef(format string, a ...any) error {
	return &exitError{code: 2, err: fmt.Errorf(format, a...)}
}

// noArgs refuses positional arguments.
func noArgs(cmd *cobra.Command, args []string) error {
	if len(args) > 0 {
		return usagef("unexpected argument %q: %s takes no arguments (flags start with --)",
			args[0], cmd.CommandPath())
	}
	return nil
}

// exactArgs wants one positional argument per name.
func exactArgs(names ...string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		switch {
		case len(args) < len(names):
			return usagef("missing %s: usage: %s",
				strings.Join(names[len(args):], " "), cmd.UseLine())
		case len(args) > len(names):
			return usagef("unexpected argument %q: usage: %s", args[len(names)], cmd.UseLine())
		}
		return nil
	}
}

// completeWords completes a flag from a fixed list of values.
func completeWords(cmd *cobra.Command, flag string, words ...string) {
	if err := cmd.RegisterFlagCompletionFunc(flag,
		cobra.FixedCompletions(words, cobra.ShellCompDirectiveNoFileComp)); err != nil {
		panic(err)
	}
}

// filenameFlags marks flags whose value is a file, for shell completion.
func filenameFlags(cmd *cobra.Command, names ...string) {
	for _, n := range names {
		if err := cmd.MarkFlagFilename(n); err != nil {
			panic(err)
		}
	}
}

// tlsClientFlags adds the client side's one TLS scheme, the same in every
// command that connects to leasehold: --tls-ca verifies leasehold's
// certificate (and turns TLS on), --tls-cert and --tls-key are the client
// certificate for mTLS. (Consul's TLS comes from the standard CONSUL_CACERT,
// CONSUL_CLIENT_CERT and CONSUL_CLIENT_KEY everywhere.)
func tlsClientFlags(fs *pflag.FlagSet, ca, cert, key *string, conn, certNote string) {
	fs.StringVar(ca, "tls-ca", "", "PEM CA bundle verifying leasehold's certificate: TLS on "+conn)
	fs.StringVar(cert, "tls-cert", "", "PEM client certificate for mTLS on "+conn+" ("+certNote+")")
	fs.StringVar(key, "tls-key", "", "PEM private key of --tls-cert")
}
