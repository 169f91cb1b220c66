"""The diff page's inline CSS and JavaScript (accucheck.report.html_diff), as strings: no CDN,
no network, nothing loaded. Imports nothing.

The script reads one JSON blob (`<script type="application/json" id="acc-cells">`: a list of
cells, FIELDS below in order, the empty ones at the end left out) and does three things: the
step switch (one heatmap panel at a time, and the control band of that step), the request switch
(the heatmap's colours and marks from one request's records, `req_colour`, and that request's
curves; "all": the worst over requests) and the detail box (hover a cell to see its worst
record's metrics and both sides' statistics, click to pin it). Without JavaScript every panel
shows, coloured over all requests.
"""
from __future__ import annotations

# the order of a cell's fields in the JSON blob; the script names them in the same order. Rare
# fields last (a row ends at its last non-empty field): keep that when adding one
FIELDS = ("key", "status", "rel_l2", "cosine", "max_abs", "tolerance", "input_rel_l2",
          "input_from", "records", "per_request", "req_colour", "ref", "cand", "basis",
          "control_ratio", "excess", "threshold", "control", "golden", "marks", "dtype",
          "shape", "links", "rank", "cand_key", "routing")
TEXT_FIELDS = ("key", "status", "basis", "input_from", "records", "control", "golden", "dtype",
               "shape", "links", "rank", "cand_key", "routing")  # shown as they are
# `ref` / `cand`: that side's index statistics (store.Stats), in this order; the counts only
# as far as one is not zero (a missing count is 0); `cand` 0: the same as `ref` (3 digits)
STATS = ("min", "max", "mean", "std", "absmax", "l2", "nan", "inf", "zero")

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:16px 24px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 8px}h2{font-size:17px;margin:24px 0 8px}h3{font-size:15px;margin:8px 0}
#verdict{font:600 14px/1.5 ui-monospace,monospace;padding:10px 12px;border-radius:4px;
 white-space:pre-wrap;word-break:break-word}
#verdict.fail{background:#fde8e6;border-left:6px solid #c0392b}
#verdict.pass{background:#e6f5ea;border-left:6px solid #2e8b57}
pre{background:#f6f6f6;padding:8px;overflow-x:auto;font-size:12px}
.meta{color:#555;font-size:12px}
.wrap{display:flex;gap:16px;align-items:flex-start}
#detail{position:sticky;top:8px;min-width:300px;max-width:380px;font:12px/1.5 ui-monospace,
 monospace;border:1px solid #ccc;border-radius:4px;padding:8px;background:#fafafa;
 word-break:break-all}
#detail table td{padding:0 6px 0 0;vertical-align:top}#detail table td:first-child{white-space:nowrap}
.steps button{margin:0 4px 4px 0;padding:2px 8px;border:1px solid #888;background:#fff;
 border-radius:3px;cursor:pointer}
.steps button.on{background:#333;color:#fff}
table.hm{border-collapse:collapse;font-size:10px;margin-bottom:8px}
table.hm th{font-weight:normal;padding:0 3px;white-space:nowrap}
table.hm thead th{writing-mode:vertical-rl;transform:rotate(180deg);text-align:left;
 vertical-align:bottom;max-height:160px}
table.hm td{width:16px;height:12px;padding:0;border:1px solid #fff;text-align:center;
 font-size:10px;line-height:11px;cursor:pointer}
table.hm td.e{background:#fff;cursor:default}
table.hm td.nc{background:repeating-linear-gradient(45deg,#bbb 0 2px,#eee 2px 5px)}
table.hm td.sel{outline:2px solid #000}
.z{background:#f2f8f2}.b0{background:#e3f1e3}.b1{background:#c9e6c9}.b2{background:#a6d6a6}
.b3{background:#7fc27f}.b4{background:#d8e27a}.b5{background:#fdd49e}.b6{background:#fdae6b}
.b7{background:#f16913}.b8{background:#d94801;color:#fff}.b9{background:#7f2704;color:#fff}
td.m-culprit,td.m-first{outline:2px solid #000;font-weight:bold}
td.m-sus{outline:2px dashed #7b2cbf}
.legend span{display:inline-block;min-width:44px;padding:1px 4px;margin:0 2px 2px 0;
 font-size:11px;border:1px solid #ddd}
table.t{border-collapse:collapse;font-size:12px}
table.t td,table.t th{border:1px solid #ddd;padding:2px 6px;text-align:right}
table.t td:first-child,table.t th:first-child{text-align:left}
#detail table.st{margin-top:6px;border-collapse:collapse}
#detail table.st td,#detail table.st th{padding:0 6px;text-align:right;border-bottom:1px solid #eee}
.alt{display:none}
.real{color:#c0392b;font-weight:bold}.tie{color:#8a6d00}
svg text{font:10px sans-serif}
"""

JS = """
(function(){
var F=%FIELDS%, T=%TEXT_FIELDS%, S=%STATS%, M=%MARKS%, I={};
for(var i=0;i<F.length;i++)I[F[i]]=i;
var HIDE=['req_colour','ref','cand','per_request'];
var cells=JSON.parse(document.getElementById('acc-cells').textContent);
var box=document.getElementById('detail'), pinned=null, sel={step:'all',req:'all'};
var rbar=document.getElementById('reqs'), RQ=rbar?rbar.getAttribute('data-reqs').split(' '):[];
function fmt(v){if(v===null||v===undefined)return '-';if(typeof v!=='number')return String(v);
 if(v===0)return '0';var a=Math.abs(v);return (a>=1e-3&&a<1e4)?v.toPrecision(3):v.toExponential(2);}
var ESC={'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'};
function esc(s){return String(s).replace(/[&<>"]/g,function(ch){return ESC[ch];});}
function tr(k,v){return '<tr><td>'+esc(k)+'</td><td>'+esc(v)+'</td></tr>';}
function stats(a,b){if(!a&&!b)return '';var n=Math.max(a?a.length:0,b?b.length:0);
 function at(x,i){return x?fmt(i<x.length?x[i]:0):'-';}
 var h='<table class="st"><tr><th></th><th>ref</th><th>cand</th></tr>';
 for(var i=0;i<Math.max(n,6);i++)
  h+='<tr><td>'+S[i]+'</td><td>'+at(a,i)+'</td><td>'+at(b,i)+'</td></tr>';
 return h+'</table>';}
function show(td){var c=cells[+td.getAttribute('data-c')];if(!c)return;
 var rows='', qi=RQ.indexOf(sel.req), pr=c[I.per_request];
 if(qi>=0){var v=pr?pr[qi]:(String(c[0]).indexOf('r'+sel.req+'.')===0?c[I.rel_l2]:null);
  rows+=tr('request',sel.req+': '+(v===null||v===undefined?'no record compared here':
   'largest rel_l2 here '+fmt(v)));
  if(String(c[0]).indexOf('r'+sel.req+'.')!==0)
   rows+=tr('shown','the worst record over all requests');}
 for(var i=0;i<F.length;i++){var v=c[i];
  if(HIDE.indexOf(F[i])>=0||v===null||v===undefined||v===''||(Array.isArray(v)&&!v.length))continue;
  if(Array.isArray(v))v=v.map(fmt).join(', ');
  rows+=tr(F[i],T.indexOf(F[i])>=0?String(v):fmt(v));}
 if(pr&&pr.length)rows+=tr('per_request',
  pr.map(function(x,j){return 'r'+RQ[j]+' '+fmt(x);}).join(', '));
 box.innerHTML='<table>'+rows+'</table>'+stats(c[I.ref],c[I.cand]===0?c[I.ref]:c[I.cand])
  +(pinned?'<div>(pinned: click again to release)</div>':'');}
document.addEventListener('mouseover',function(e){var td=e.target.closest('td[data-c]');
 if(td&&!pinned)show(td);});
document.addEventListener('click',function(e){var td=e.target.closest('td[data-c]');if(!td)return;
 if(pinned){pinned.classList.remove('sel');}
 if(pinned===td){pinned=null;return;}
 pinned=td;td.classList.add('sel');show(td);});
var tds=document.querySelectorAll('td[data-c]'), orig=null;
function paint(){var qi=RQ.indexOf(sel.req);
 if(!orig){orig=[];for(var i=0;i<tds.length;i++)
  orig.push([tds[i].className.replace(/ ?\\bsel\\b/,''),tds[i].textContent]);}
 for(var i=0;i<tds.length;i++){var td=tds[i], cls=orig[i][0], txt=orig[i][1];
  var b=qi>=0?cells[+td.getAttribute('data-c')][I.req_colour]:null;
  if(b){var ch=b.charAt(qi), mq=(td.getAttribute('data-q')||'').split(' ');
   cls=ch==='z'?'z':ch==='n'?'nc':ch==='-'?'e':'b'+ch;txt='';
   for(var m=0;m<M.length;m++)if(mq.indexOf(M[m][0]+'.'+sel.req)>=0){
    cls+=' m-'+M[m][0];txt=txt||M[m][1];}}
  if(td===pinned)cls+=' sel';
  td.className=cls;td.textContent=txt;}}
var groups=document.querySelectorAll('svg g[data-step],svg g[data-req]');
function charts(){for(var i=0;i<groups.length;i++){var g=groups[i],
  s=g.getAttribute('data-step'),q=g.getAttribute('data-req');
  g.style.display=((s===null||s===sel.step)&&(q===null||q===sel.req))?'inline':'none';}}
function on(bar,attr,v){var bs=bar.querySelectorAll('button');for(var j=0;j<bs.length;j++)
  bs[j].classList.toggle('on',bs[j].getAttribute(attr)===v);}
var panels=document.querySelectorAll('section.panel'), bar=document.getElementById('steps');
function pick(s){sel.step=s;for(var i=0;i<panels.length;i++)
  panels[i].style.display=(s==='all'||panels[i].getAttribute('data-step')===s)?'':'none';
 on(bar,'data-step',s);charts();}
function pickReq(q){sel.req=q;on(rbar,'data-req',q);paint();charts();if(pinned)show(pinned);}
if(bar&&panels.length){bar.addEventListener('click',function(e){var b=e.target.closest('button');
  if(b)pick(b.getAttribute('data-step'));});
 pick(bar.getAttribute('data-first'));}
if(rbar){rbar.addEventListener('click',function(e){var b=e.target.closest('button');
  if(b)pickReq(b.getAttribute('data-req'));});
 on(rbar,'data-req','all');}
})();
"""
