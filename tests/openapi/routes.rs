//! `openapi/openapi.yaml` describes exactly the router's routes: the same set
//! of (method, path) as the route table the router is built from, and every
//! operation that can fail documents its errors as OpenAI error bodies.

#![allow(clippy::unwrap_used)]

use serde_json::Value;
use std::collections::BTreeSet;

const METHODS: &[&str] = &[
    "get", "put", "post", "delete", "patch", "head", "options", "trace",
];

fn spec() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../openapi/openapi.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml_ng::from_str(&text).unwrap()
}

fn operations(spec: &Value) -> Vec<(String, String, Value)> {
    let mut out = Vec::new();
    for (path, item) in spec["paths"].as_object().unwrap() {
        for (method, operation) in item.as_object().unwrap() {
            if METHODS.contains(&method.as_str()) {
                out.push((method.to_uppercase(), path.clone(), operation.clone()));
            }
        }
    }
    out
}

#[test]
fn the_spec_and_the_router_have_the_same_routes() {
    let spec = spec();
    assert_eq!(spec["openapi"], "3.1.0");
    let documented: BTreeSet<(String, String)> = operations(&spec)
        .into_iter()
        .map(|(method, path, _)| (method, path))
        .collect();
    let served: BTreeSet<(String, String)> = connex_router::route_list()
        .into_iter()
        .map(|(method, path)| (method.to_string(), path.to_string()))
        .collect();
    let missing: Vec<_> = served.difference(&documented).collect();
    let extra: Vec<_> = documented.difference(&served).collect();
    assert!(missing.is_empty(), "routes the spec lacks: {missing:?}");
    assert!(extra.is_empty(), "spec routes the router lacks: {extra:?}");
}

/// Follows a local `$ref`.
fn resolve<'a>(spec: &'a Value, value: &'a Value) -> &'a Value {
    match value.get("$ref").and_then(Value::as_str) {
        Some(reference) => spec
            .pointer(reference.trim_start_matches('#'))
            .unwrap_or_else(|| panic!("dangling $ref {reference}")),
        None => value,
    }
}

#[test]
fn every_operation_that_takes_input_documents_openai_error_bodies() {
    let spec = spec();
    for (method, path, operation) in operations(&spec) {
        let takes_input = operation.get("requestBody").is_some()
            || path.contains('{')
            || operation.get("security").is_some();
        let responses = operation["responses"].as_object().unwrap();
        assert!(
            responses.keys().any(|s| s.starts_with('2')),
            "{method} {path}: no success response"
        );
        if !takes_input {
            continue;
        }
        let errors: Vec<&String> = responses.keys().filter(|s| s.starts_with('4')).collect();
        assert!(!errors.is_empty(), "{method} {path}: no error response");
        for status in errors {
            let response = resolve(&spec, &responses[status]);
            let schema = response
                .pointer("/content/application~1json/schema")
                .unwrap_or_else(|| panic!("{method} {path} {status}: no JSON body"));
            // Engine answers passed through are the one documented exception.
            if status != "4XX" {
                assert_eq!(
                    schema["$ref"], "#/components/schemas/Error",
                    "{method} {path} {status}: not an OpenAI error body"
                );
            }
        }
    }
}

#[test]
fn each_operation_names_the_listener_that_serves_it() {
    let spec = spec();
    let served: BTreeSet<(String, String, String)> = connex_router::route_table()
        .into_iter()
        .map(|(method, path, listener)| {
            (
                method.to_string(),
                path.to_string(),
                listener.as_str().to_string(),
            )
        })
        .collect();
    let documented: BTreeSet<(String, String, String)> = operations(&spec)
        .into_iter()
        .map(|(method, path, operation)| {
            let listener = operation["x-connex-listener"].as_str().unwrap_or("none");
            (method, path, listener.to_string())
        })
        .collect();
    assert_eq!(served, documented);
}
