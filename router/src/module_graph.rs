//! No import cycle anywhere in the crate's module tree: in every folder (the
//! crate root included), the graph of its direct children (its files, its
//! sub-folders, and its own `lib.rs`/`mod.rs`), where A -> B when code in A
//! (or below it) names something in B, has no cycle. So each module uses only
//! modules "below" it, and any of them can be built and tested without the
//! ones that use it.
//!
//! Simple text scanning, on the source with its comments and string literals
//! blanked: a name is a path that starts with `crate::`, `super::`, `self::`
//! or a child module's name (`use` trees with braces expanded). A test module
//! inside a file, or one in a file of its own through `#[path]`, counts as
//! the module it tests. A name of an item of the folder's own file (`use
//! super::Thing` where `Thing` lives in `mod.rs`) is an edge to that file:
//! siblings name each other directly, and `mod.rs` only declares and
//! re-exports.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's path from the crate root (`["pd", "attempt"]`; `[]`: the root).
type ModPath = Vec<String>;

/// A name one file's code makes: where, and the module path it resolves to.
#[derive(Debug, Clone)]
struct Name {
    line: usize,
    target: ModPath,
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// `text` with its comments, string and char literals blanked (newlines
/// kept, so that line numbers stay).
fn strip(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = b.to_vec();
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut out[from..to.min(b.len())] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    let mut i = 0;
    while i < b.len() {
        let prev_ident = i > 0 && is_ident(b[i - 1]);
        if b[i..].starts_with(b"//") {
            let end = b[i..]
                .iter()
                .position(|&c| c == b'\n')
                .map_or(b.len(), |n| i + n);
            blank(&mut out, i, end);
            i = end;
        } else if b[i..].starts_with(b"/*") {
            let (mut depth, mut j) = (0usize, i);
            while j < b.len() {
                if b[j..].starts_with(b"/*") {
                    depth += 1;
                    j += 2;
                } else if b[j..].starts_with(b"*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            blank(&mut out, i, j);
            i = j;
        } else if !prev_ident && (b[i] == b'r' || b[i..].starts_with(b"br")) && {
            let at = if b[i] == b'b' { i + 2 } else { i + 1 };
            let hashes = b[at..].iter().take_while(|&&c| c == b'#').count();
            b.get(at + hashes) == Some(&b'"')
        } {
            let at = if b[i] == b'b' { i + 2 } else { i + 1 };
            let hashes = b[at..].iter().take_while(|&&c| c == b'#').count();
            let mut close = vec![b'"'];
            close.extend(std::iter::repeat_n(b'#', hashes));
            let body = at + hashes + 1;
            let end = b[body..]
                .windows(close.len())
                .position(|w| w == close.as_slice())
                .map_or(b.len(), |n| body + n + close.len());
            blank(&mut out, i, end);
            i = end;
        } else if b[i] == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            blank(&mut out, i, j + 1);
            i = j + 1;
        } else if b[i] == b'\'' {
            // A char literal ('x', '\n', '\u{..}', 'é'), else a lifetime.
            let end = if b.get(i + 1) == Some(&b'\\') {
                b[i + 2..]
                    .iter()
                    .position(|&c| c == b'\'')
                    .map(|n| i + 2 + n)
            } else {
                let width = match b.get(i + 1) {
                    Some(&c) if c >= 0xF0 => 4,
                    Some(&c) if c >= 0xE0 => 3,
                    Some(&c) if c >= 0xC0 => 2,
                    _ => 1,
                };
                (b.get(i + 1 + width) == Some(&b'\'')).then_some(i + 1 + width)
            };
            match end {
                Some(end) => {
                    blank(&mut out, i, end + 1);
                    i = end + 1;
                }
                None => i += 1,
            }
        } else {
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The paths of the `use` tree or path that starts at `i` (`a::{b, c::d}`:
/// `a::b`, `a::c::d`), and where it ends.
fn parse_tree(s: &[u8], mut i: usize) -> (Vec<Vec<String>>, usize) {
    let skip_space = |i: &mut usize| {
        while *i < s.len() && s[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    let mut prefix: Vec<String> = Vec::new();
    loop {
        skip_space(&mut i);
        if s.get(i) == Some(&b'{') {
            i += 1;
            let mut paths = Vec::new();
            loop {
                while i < s.len() && (s[i].is_ascii_whitespace() || s[i] == b',') {
                    i += 1;
                }
                if i >= s.len() || s[i] == b'}' {
                    return (paths, i + 1);
                }
                let (inner, end) = parse_tree(s, i);
                if end == i {
                    i += 1;
                    continue;
                }
                paths.extend(inner.into_iter().map(|p| [prefix.clone(), p].concat()));
                i = end;
                // `as name`: the rename is no path.
                skip_space(&mut i);
                if s[i..].starts_with(b"as") && s.get(i + 2).is_some_and(u8::is_ascii_whitespace) {
                    i += 2;
                    skip_space(&mut i);
                    while i < s.len() && is_ident(s[i]) {
                        i += 1;
                    }
                }
            }
        }
        let start = i;
        if s.get(i) == Some(&b'*') {
            i += 1;
        } else {
            while i < s.len() && is_ident(s[i]) {
                i += 1;
            }
        }
        if i == start {
            let paths = if prefix.is_empty() {
                vec![]
            } else {
                vec![prefix]
            };
            return (paths, i);
        }
        prefix.push(String::from_utf8_lossy(&s[start..i]).into_owned());
        let mut j = i;
        skip_space(&mut j);
        if s[j..].starts_with(b"::") {
            i = j + 2;
            continue;
        }
        // `as name` renames: the name is the path's.
        return (vec![prefix], i);
    }
}

/// For each line, the inline modules (`mod tests {`) it is inside.
fn inline_modules(stripped: &str) -> Vec<Vec<String>> {
    let mut open: Vec<(String, String)> = Vec::new();
    let mut inside = Vec::new();
    for line in stripped.lines() {
        let line = line.trim_end();
        inside.push(open.iter().map(|(name, _)| name.clone()).collect());
        if open.last().is_some_and(|(_, close)| line == close) {
            open.pop();
            continue;
        }
        let indent = &line[..line.len() - line.trim_start().len()];
        let words: Vec<&str> = line.split_whitespace().collect();
        let at = words.iter().position(|w| *w == "mod");
        if let Some(at) = at {
            let before_ok = words[..at]
                .iter()
                .all(|w| *w == "pub" || w.starts_with("pub("));
            if before_ok && words.len() == at + 3 && words[at + 2] == "{" {
                open.push((words[at + 1].to_string(), format!("{indent}}}")));
            }
        }
    }
    inside
}

/// Resolves `path` as named from module `at` (`crate::`, `super::`,
/// `self::`, or a child of `at`); None when it names nothing of the crate.
fn resolve(at: &[String], path: &[String], modules: &BTreeSet<ModPath>) -> Option<ModPath> {
    let first = path.first()?;
    let mut target: ModPath;
    let mut rest = path;
    // `$crate` in a macro reads as `crate` (the `$` is not part of the name).
    match first.as_str() {
        "crate" => {
            target = Vec::new();
            rest = &path[1..];
        }
        "super" | "self" => {
            target = at.to_vec();
            while let Some(seg) = rest.first() {
                match seg.as_str() {
                    "super" => {
                        target.pop()?;
                    }
                    "self" => {}
                    _ => break,
                }
                rest = &rest[1..];
            }
        }
        child => {
            let mut module = at.to_vec();
            module.push(child.to_string());
            if !modules.contains(&module) {
                return None;
            }
            target = at.to_vec();
        }
    }
    target.extend(rest.iter().filter(|s| *s != "self").cloned());
    Some(target)
}

/// Every name `text` (the file of module `module`) makes of the crate.
fn names(text: &str, module: &[String], modules: &BTreeSet<ModPath>) -> Vec<Name> {
    let stripped = strip(text);
    let inline = inline_modules(&stripped);
    let s = stripped.as_bytes();
    let mut line_starts = vec![0];
    line_starts.extend(
        s.iter()
            .enumerate()
            .filter(|(_, &c)| c == b'\n')
            .map(|(i, _)| i + 1),
    );
    let mut found = Vec::new();
    let mut i = 0;
    while i < s.len() {
        let starts = is_ident(s[i]) && !s[i].is_ascii_digit() && (i == 0 || !is_ident(s[i - 1]));
        // The middle of a path (`a::b`) is read with its start.
        let mid_path = s[..i].trim_ascii_end().ends_with(b"::");
        if !starts || mid_path {
            i += 1;
            continue;
        }
        let (paths, end) = parse_tree(s, i);
        let line = line_starts.partition_point(|&start| start <= i);
        let mut at = module.to_vec();
        at.extend(inline[line - 1].iter().cloned());
        for path in paths.iter().filter(|p| p.len() > 1) {
            if let Some(target) = resolve(&at, path, modules) {
                found.push(Name { line, target });
            }
        }
        i = end.max(i + 1);
    }
    found
}

/// The library's files (relative to `src`) and the module each one is.
fn files(src: &Path) -> BTreeMap<PathBuf, ModPath> {
    let mut files = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let relative = path.strip_prefix(src).unwrap().to_path_buf();
            // The binaries are crates of their own.
            if relative == Path::new("bin") || relative == Path::new("main.rs") {
                continue;
            }
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let mut module: ModPath = relative
                .with_extension("")
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if module == ["lib"] || module.last().is_some_and(|m| m == "mod") {
                module.pop();
            }
            files.insert(relative, module);
        }
    }
    // `#[path = "x.rs"] mod name;`: x.rs is `name`, a child of the declaring module.
    for (file, module) in files.clone() {
        let text = std::fs::read_to_string(src.join(&file)).unwrap();
        // Found in code only (its string read from the text itself).
        for (at, _) in strip(&text).match_indices("#[path") {
            let rest = &text[at..];
            let Some(open) = rest.find('"') else { continue };
            let rest = &rest[open + 1..];
            let Some(close) = rest.find('"') else {
                continue;
            };
            let Some(decl) = rest.find("mod ") else {
                continue;
            };
            let name: String = rest[decl + 4..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let target = file.parent().unwrap().join(&rest[..close]);
            let mut child = module.clone();
            child.push(name);
            files.insert(target, child);
        }
    }
    files
}

/// One folder's graph: child -> (child it names, a witness `file:line`).
type Graph = BTreeMap<String, BTreeMap<String, String>>;

/// Every folder's graph, by the folder's path in `src` (`""`: the root).
fn graphs() -> BTreeMap<String, Graph> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = files(&src);
    let modules: BTreeSet<ModPath> = files.values().cloned().collect();
    // Folders: the modules with a `lib.rs`/`mod.rs`, and their children.
    let mut folders: BTreeMap<ModPath, (String, BTreeMap<String, String>)> = BTreeMap::new();
    // (its own file's name, its children as shown: `attempt.rs`, `http/`)
    for (file, module) in &files {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        if name == "lib.rs" || name == "mod.rs" {
            folders.entry(module.clone()).or_default().0 = name;
        }
    }
    let folder_paths: BTreeSet<ModPath> = folders.keys().cloned().collect();
    for module in &modules {
        if let Some((last, parent)) = module.split_last() {
            if let Some((_, children)) = folders.get_mut(parent) {
                let shown = if folder_paths.contains(module) {
                    format!("{last}/")
                } else {
                    format!("{last}.rs")
                };
                children.insert(last.clone(), shown);
            }
        }
    }
    let node = |folder: &ModPath, path: &ModPath| -> Option<String> {
        let (own, children) = &folders[folder];
        if !path.starts_with(folder) {
            return None;
        }
        Some(
            path.get(folder.len())
                .and_then(|child| children.get(child))
                .unwrap_or(own)
                .clone(),
        )
    };
    let mut graphs = BTreeMap::new();
    for folder in folders.keys() {
        graphs.insert(folder.join("/"), Graph::new());
    }
    for (file, module) in &files {
        let text = std::fs::read_to_string(src.join(file)).unwrap();
        for name in names(&text, module, &modules) {
            for folder in folders.keys() {
                let (Some(from), Some(to)) = (node(folder, module), node(folder, &name.target))
                else {
                    continue;
                };
                if from != to {
                    let witness = format!(
                        "{}:{} names {}",
                        file.display(),
                        name.line,
                        name.target.join("::")
                    );
                    graphs
                        .get_mut(&folder.join("/"))
                        .unwrap()
                        .entry(from)
                        .or_default()
                        .entry(to)
                        .or_insert(witness);
                }
            }
        }
    }
    graphs
}

/// A cycle of `graph`, if it has one (depth-first, from each node in turn).
fn cycle(graph: &Graph) -> Option<Vec<String>> {
    fn walk(
        graph: &Graph,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        let last = path.last().unwrap().clone();
        for next in graph.get(&last).into_iter().flat_map(|n| n.keys()) {
            if let Some(at) = path.iter().position(|p| p == next) {
                let mut found = path[at..].to_vec();
                found.push(next.clone());
                return Some(found);
            }
            if done.contains(next) {
                continue;
            }
            path.push(next.clone());
            if let Some(found) = walk(graph, path, done) {
                return Some(found);
            }
            path.pop();
        }
        done.insert(last);
        None
    }
    let mut done = BTreeSet::new();
    for start in graph.keys() {
        if !done.contains(start) {
            if let Some(found) = walk(graph, &mut vec![start.clone()], &mut done) {
                return Some(found);
            }
        }
    }
    None
}

#[test]
fn no_folder_has_an_import_cycle() {
    let graphs = graphs();
    assert!(
        graphs.contains_key("") && graphs.contains_key("pd") && graphs.contains_key("membership")
    );
    assert!(graphs[""].contains_key("pd/"), "{:?}", graphs[""].keys());
    // The flags are read by every layer and read none: `config/` names no
    // other module of the crate (a node with no edges has no entry).
    assert!(graphs.contains_key("config"), "config/ is a folder");
    let config = graphs[""].get("config/");
    assert!(config.is_none(), "config must be a leaf: {config:?}");
    let mut cycles = Vec::new();
    for (folder, graph) in &graphs {
        if let Some(found) = cycle(graph) {
            let why: Vec<&str> = found
                .windows(2)
                .map(|pair| graph[&pair[0]][&pair[1]].as_str())
                .collect();
            cycles.push(format!(
                "router/src/{folder}: {} ({})",
                found.join(" -> "),
                why.join("; ")
            ));
        }
    }
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

/// The scanner reads what the compiler would: `use` trees, paths in code,
/// relative names; never comments or strings.
#[test]
fn the_scanner_finds_names_in_trees_and_code_and_not_in_comments_or_strings() {
    let modules: BTreeSet<ModPath> = [
        vec![],
        vec!["a".to_string()],
        vec!["a".to_string(), "b".to_string()],
        vec!["a".to_string(), "c".to_string()],
        vec!["d".to_string()],
    ]
    .into_iter()
    .collect();
    let text = r#"
use super::{c::{self, X}, b as bee};
// use crate::d::Gone;
/* crate::d::Gone */
fn f() { let s = "crate::d::Gone"; let c = '{'; crate::d::run::<u8>(); }
mod tests {
    use super::super::Thing;
}
"#;
    let module = vec!["a".to_string(), "b".to_string()];
    let targets: Vec<String> = names(text, &module, &modules)
        .into_iter()
        .map(|n| format!("{}:{}", n.line, n.target.join("::")))
        .collect();
    assert_eq!(
        targets,
        ["2:a::c", "2:a::c::X", "2:a::b", "5:d::run", "7:a::Thing"],
        "{targets:?}"
    );
}
